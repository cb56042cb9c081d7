"""The ``set-based`` backend: passages read as a set (arXiv 2406.06581). Order invariance on the
real SmolLM2 and real KV data; the attention against an independent computation (each passage
run alone over the prefix's KV cache at its parallel positions, the caches joined, the question
run over them) on tiny seeded models of two architectures."""

from __future__ import annotations

import pytest
import torch
from conftest import BUNDLED, tiny_folder, tiny_model

from ragfix.backends.passages import passage_set
from ragfix.backends.set_based import SetBasedBackend
from ragfix.connectors.litm import load_samples
from ragfix.errors import RagfixError
from ragfix.eval.sweep import SweepConfig, plan_cells, run_cells
from ragfix.judge.judge import PairwiseJudge
from ragfix.tasks import task_prompt

KV = BUNDLED / "kv_16pairs_sample.jsonl.gz"


@pytest.fixture(scope="module")
def kv_samples():
    return load_samples(KV, 6, 2)


def _prompts(sample):
    return [task_prompt(sample, sample.passages_with_gold_at(p)) for p in range(6)]


@pytest.mark.parametrize("align", ["end", "start"])
def test_moving_the_gold_pair_leaves_the_next_token_distribution_equal(smol, kv_samples, align):
    backend = SetBasedBackend(smol.model, smol.tokenizer, align=align)
    lp = backend.next_token_logprobs(_prompts(kv_samples[0]), batch_size=3)
    assert lp.shape == (6, len(smol.tokenizer))
    assert (lp - lp[0]).abs().max().item() < 1e-4
    # the vanilla model reads them differently
    ordered = smol.next_token_logprobs(_prompts(kv_samples[0])[:2])
    assert (ordered[0] - ordered[1]).abs().max().item() > 1e-2


def test_the_sweep_gives_one_answer_at_every_position(kv_samples, tmp_path):
    """The sweep's cells through the set-based backend, on a tiny seeded model whose vanilla
    answers differ between the gold pair's positions, for both samples (seed 7: there the
    passages read at their ordered positions under the block mask answer differently too)."""
    from ragfix.backends import load_backend

    folder = str(tiny_folder(tmp_path / "tiny", seed=7))
    vanilla = load_backend("vanilla", model=folder, device="cpu")

    def sweep(backend, name):
        config = SweepConfig(data="kv", task="kv", num_docs=6, model=folder, backend=name)
        records = {}
        cells = plan_cells(config, kv_samples, list(range(6)))
        run_cells(backend, cells, lambda r: records.__setitem__(r.cell_id, r), batch_size=6)
        return records

    ordered = sweep(vanilla, "vanilla")
    records = sweep(SetBasedBackend(vanilla.model, vanilla.tokenizer), "set-based")
    for s in kv_samples:
        assert len({r.answer for r in ordered.values() if r.sample_id == s.id}) > 1
        answers = {r.answer for r in records.values() if r.sample_id == s.id}
        assert len(answers) == 1 and answers != {""}
    flat = {r.sample_id: r.correct for r in records.values()}
    assert all(r.correct == flat[r.sample_id] for r in records.values())


def test_the_judges_answer_blocks_are_read_as_a_set(smol):
    from ragfix.prompts import TaskPrompt

    judge = PairwiseJudge(SetBasedBackend(smol.model, smol.tokenizer), style="verdict")
    prompt = judge.prompt("Is water wet?", "Yes, it is.", "No.", None)
    blocks = prompt.passage_texts()
    assert [b.splitlines()[0] for b in blocks] == [
        "[The Start of Assistant A's Answer]",
        "[The Start of Assistant B's Answer]",
    ]
    # the same blocks, B's first: the same reading (each block keeps its slot label)
    (a0, a1), (b0, b1) = prompt.passages
    head, sep = prompt.user[:a0], prompt.passage_separator
    user = head + blocks[1] + sep + blocks[0]
    swapped = TaskPrompt(
        user=user,
        assistant_prefix=prompt.assistant_prefix,
        max_new_tokens=prompt.max_new_tokens,
        stop_at_newline=False,
        passages=((a0, a0 + len(blocks[1])), (a0 + len(blocks[1]) + len(sep), len(user))),
        passage_separator=sep,
    )
    lp = judge.backend.next_token_logprobs([prompt, swapped])
    assert (lp[0] - lp[1]).abs().max().item() < 1e-4


def test_a_prompt_without_passages_is_refused_in_one_line(smol):
    backend = SetBasedBackend(smol.model, smol.tokenizer)
    with pytest.raises(RagfixError, match="reads a prompt's passages as a set") as e:
        backend.generate(["Where is Paris?"])
    assert "\n" not in str(e.value)


def _independent_logits(model, s, align: str) -> torch.Tensor:
    """The next-token logits of a passage set computed without a block mask: the prefix run
    alone, each passage run alone over a copy of the prefix's cache at its parallel positions,
    the per-layer keys and values joined in prompt order, the suffix run over them."""
    import copy

    from transformers import DynamicCache

    pos = s.positions(align)
    n = len(s.prefix)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([s.prefix]), use_cache=True)
        base = out.past_key_values
        layers = len(base.layers)
        keys = [[base.layers[i].keys] for i in range(layers)]
        values = [[base.layers[i].values] for i in range(layers)]
        at = n
        for p in s.passages:
            cache = copy.deepcopy(base)
            model(
                input_ids=torch.tensor([p]),
                position_ids=torch.tensor([pos[at : at + len(p)]]),
                past_key_values=cache,
                use_cache=True,
            )
            for i in range(layers):
                keys[i].append(cache.layers[i].keys[:, :, n:])
                values[i].append(cache.layers[i].values[:, :, n:])
            at += len(p)
        joined = DynamicCache()
        for i in range(layers):
            joined.update(torch.cat(keys[i], dim=2), torch.cat(values[i], dim=2), i)
        res = model(
            input_ids=torch.tensor([s.suffix]),
            position_ids=torch.tensor([pos[at:]]),
            past_key_values=joined,
        )
    return res.logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("align", ["end", "start"])
def test_attention_equals_an_independent_computation(smol, kv_samples, arch, align):
    model = tiny_model(arch, seed=1, attn="sdpa", vocab_size=len(smol.tokenizer))
    backend = SetBasedBackend(model, smol.tokenizer, align=align)
    prompts = _prompts(kv_samples[0])[:2]
    got = torch.log_softmax(backend._run([passage_set(backend, prompts[0])])[0][0, -1], -1)
    want = torch.log_softmax(
        _independent_logits(model, passage_set(backend, prompts[0]), align), -1
    )
    assert (got - want).abs().max().item() < 1e-4
    # batched with another prompt (left padding) the rows are the same
    both = backend.next_token_logprobs(prompts, batch_size=2)
    assert (both[0] - want).abs().max().item() < 1e-4
