"""Continuous batching at the model interface (``Backend.decoder``): rows that join a running
batch at different steps, rows that leave it (finished or dropped), each answered as it is
alone (``generate([prompt])``) on the real SmolLM2 in fp32; backends that cannot decode step
by step answer by whole ``generate`` calls. The sliding-window families are checked in
tests/test_families.py."""

from __future__ import annotations

import threading

import pytest
import torch

from ragfix.backends.base import Decoder
from ragfix.backends.step_decoder import StepDecoder
from ragfix.errors import Cancelled
from ragfix.prompts import TaskPrompt

#: prompts of different lengths (8 to about 90 tokens of user turn) and budgets; one of one token
PROMPTS = [
    TaskPrompt(user=u, max_new_tokens=n, stop_at_newline=False)
    for u, n in [
        ("What is the capital of France?", 12),
        ("Write a long story about a lighthouse keeper and his cat. " * 3, 20),
        ("Name a fruit.", 6),
        ("Explain, in detail, how a bicycle works and why it stays upright. " * 4, 16),
        ("Count to ten.", 14),
        ("Say yes.", 1),
    ]
]


class Forwards:
    """Counts the model's forward passes."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self._count)

    def _count(self, *args):
        self.n += 1


@pytest.fixture(scope="module")
def alone(smol):
    """Each prompt's answer alone, with its first-step log-probabilities."""
    return [smol.generate([p], first_logprobs=True)[0] for p in PROMPTS]


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "prefix-reuse"])
def test_rows_that_join_at_different_steps_answer_as_alone(smol, alone, reuse):
    """Rows added before the first step, after two steps (two at once), after five (the longest
    prompt: every row already in the cache is padded on the left) and after the first rows left
    (their padding cut): every answer equals its answer alone token for token; the first-step
    log-probabilities are the alone prefill's (bitwise without prefix reuse; within 1e-4 over a
    reused prefix); each step is one forward pass over all the rows in the cache, up to four
    of them."""
    dec = smol.decoder(prefix_reuse=reuse)
    assert isinstance(dec, StepDecoder) and dec.continuous
    forwards = Forwards(smol.model)
    rows: dict[int, int] = {}
    got: dict = {}
    widest = 0

    def steps(n):
        nonlocal widest
        for _ in range(n):
            in_cache = len(dec._order)
            before = forwards.n
            got.update(dec.step())
            assert forwards.n - before == (1 if in_cache else 0)
            widest = max(widest, in_cache)

    try:
        rows[dec.add(PROMPTS[0], first_logprobs=True)] = 0
        steps(2)
        rows[dec.add(PROMPTS[1], first_logprobs=True)] = 1
        rows[dec.add(PROMPTS[2], first_logprobs=True)] = 2
        steps(3)
        before = forwards.n
        rows[dec.add(PROMPTS[3], first_logprobs=True)] = 3
        assert forwards.n - before == 1  # its prefill
        steps(8)
        assert len(got) >= 2  # some rows have left
        rows[dec.add(PROMPTS[4], first_logprobs=True)] = 4
        rows[dec.add(PROMPTS[5], first_logprobs=True)] = 5  # done at its prefill
        while len(dec):
            steps(1)
    finally:
        forwards.handle.remove()
    assert widest == 4 and sorted(got) == sorted(rows)
    for row, i in rows.items():
        gen, want = got[row], alone[i]
        assert gen.token_ids == want.token_ids and gen.text == want.text, PROMPTS[i].user
        assert gen.prompt_tokens == want.prompt_tokens and gen.new_tokens == want.new_tokens
        if reuse:
            assert (gen.first_logprobs - want.first_logprobs).abs().max() < 1e-4
        else:
            assert torch.equal(gen.first_logprobs, want.first_logprobs)
            assert gen.prefill_tokens == want.prompt_tokens


def test_a_dropped_row_leaves_at_once_and_the_others_answer_as_alone(smol, alone):
    """The longest row dropped mid-answer leaves the cache at once (the padding it alone needed
    cut) and never comes back; the other rows' answers equal their answers alone."""
    dec = smol.decoder()
    a, b, c = (dec.add(PROMPTS[i]) for i in (0, 3, 4))
    got: dict = {}
    for _ in range(3):
        got.update(dec.step())
    width = dec._mask.shape[1]
    dec.drop(b)
    assert dec._order == [a, c] and dec._mask.shape[1] < width
    assert dec._mask.shape[1] == dec._mask.sum(1).max()  # no padding shared by every row
    while len(dec):
        got.update(dec.step())
    assert sorted(got) == [a, c]
    assert got[a].token_ids == alone[0].token_ids and got[c].token_ids == alone[4].token_ids
    assert dec._cache is None  # the last row gone, nothing is kept


def test_tokens_grow_one_a_step_to_the_answer(smol, alone):
    """``tokens`` (what a stream reads) grows by one token a step and ends as the answer."""
    dec = smol.decoder()
    row = dec.add(PROMPTS[0])
    seen = []
    while not (out := dec.step()):
        seen.append(dec.tokens(row))
    assert [len(s) for s in seen] == list(range(2, len(seen) + 2))
    assert out[row].token_ids == alone[0].token_ids
    assert seen[-1] == alone[0].token_ids[: len(seen[-1])]


def test_without_step_decoding_rows_are_answered_by_whole_generate_calls(smol):
    """The base decoder (a backend that does not ``supports_step_decoding``: GALI, the layout
    methods, truncation, a remote model) answers the rows sharing the first row's rules by one
    ``generate`` call, each as ``generate`` answers it; its cancel is set once all the rows'
    signals are."""
    from ragfix.backends.gali import GaliBackend

    gali = GaliBackend(smol.model, smol.tokenizer, train_window=96)
    assert not gali.supports_step_decoding and type(gali.decoder()) is Decoder
    dec = Decoder(smol)
    assert not dec.continuous
    a, b = dec.add(PROMPTS[0]), dec.add(PROMPTS[2])
    c = dec.add(PROMPTS[4], max_new_tokens=6)  # the rules of b
    d = dec.add(PROMPTS[0], max_new_tokens=3)
    first = dec.step()
    assert sorted(first) == [a]
    second = dec.step()
    assert sorted(second) == [b, c]
    want = smol.generate([PROMPTS[2], PROMPTS[4]], max_new_tokens=6)
    assert [second[b].token_ids, second[c].token_ids] == [w.token_ids for w in want]
    assert first[a].text == smol.generate([PROMPTS[0]])[0].text
    gone, here = threading.Event(), threading.Event()
    gone.set()
    e = dec.add(PROMPTS[0], max_new_tokens=3, cancel=here)
    dec.drop(d)
    assert dec.step()[e].token_ids == smol.generate([PROMPTS[0]], max_new_tokens=3)[0].token_ids
    f, g = (dec.add(PROMPTS[0], max_new_tokens=3, cancel=gone) for _ in range(2))
    out = dec.step()
    assert all(isinstance(out[r], Cancelled) for r in (f, g)) and len(dec) == 0
