"""Every backend on every model family (Llama, Mistral with a sliding window, Qwen2, Qwen3, Gemma 3
with local and global layers, Phi-3 with fused q/k/v), as tiny random-config models in fp32 and bf16
with sdpa and eager attention (vanilla's bf16 paths under sdpa): vanilla's batched, prefix-reusing
and trie paths and its step decoder (rows joining a running batch) equal plain transformers; every
method at a neutral setting (one passage, factor 1, a prompt inside the window) equals the plain
model on the tokens it reads; pine and set-based keep their order invariance; set-based equals an
independent computation; each refusal is one line, from the config, before any weights are loaded;
the committed capability table is what the backends say now.

``RAGFIX_TEST_DEVICE=cuda`` runs the same tests on a GPU (``ragfix bench gpu``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import ROOT, essays

from ragfix.backends import backend_spec, load_backend
from ragfix.backends.family import read_family
from ragfix.errors import UnsupportedModelError
from ragfix.eval.families import (
    FAMILIES,
    TINY_WINDOW,
    probe_cell,
    probe_prompts,
    probed_backends,
    tiny_config,
    tiny_family_model,
    verdict,
)
from ragfix.models.device import default_attention
from ragfix.tasks import get_task
from ragfix.types import Passage

#: where the tiny models run (``RAGFIX_TEST_DEVICE``; the CPU unless told)
DEVICE = os.environ.get("RAGFIX_TEST_DEVICE", "cpu")
VARIANTS = [
    pytest.param(torch.float32, "sdpa", id="fp32-sdpa"),
    pytest.param(torch.float32, "eager", id="fp32-eager"),
    # bf16 under the attention ragfix loads it with on this device (SDPA with float32 decoding
    # steps on the CPU, SDPA on CUDA)
    pytest.param(
        torch.bfloat16, default_attention(torch.device(DEVICE), torch.bfloat16), id="bf16-sdpa"
    ),
    pytest.param(torch.bfloat16, "eager", id="bf16-eager"),
]
#: vanilla patches no attention forward, so its bf16 paths run under one implementation: bf16
#: matrix products have no hardware path on a CPU without AVX-512 BF16 or AMX (about 8x slower
#: than fp32 here), and eager is covered in fp32 and by the methods' test
VANILLA_VARIANTS = VARIANTS[:3]
#: how far two computations of the same log-probabilities may differ (max abs, nats)
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 0.1}
#: how far the answers to two orders of the same passages may differ: fp32 holds the invariance
#: to 1e-6 on every family; bf16 rounds logits of about 10 to 0.04 and sums in another order per
#: permutation (measured up to 0.11 on the tiny Gemma 3)
INVARIANCE = {torch.float32: 1e-4, torch.bfloat16: 0.25}


@pytest.fixture(scope="module")
def tok(smol):
    return smol.tokenizer


@pytest.fixture(scope="module")
def prompts():
    return probe_prompts()


def _one_passage_prompt():
    """A QA prompt with one long passage (about 400 tokens: past the tiny sliding window)."""
    text = essays(1800)[:1800]
    return get_task("qa").prompt("what is the essay about?", [Passage(title="Essay", text=text)])


def _plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The next-token log-probabilities of the plain transformers model on ``ids`` (one row, no
    padding, no cache)."""
    with torch.no_grad():
        x = torch.tensor([ids], device=model.device)
        logits = model(input_ids=x, logits_to_keep=1).logits[0, -1].float()
    return torch.log_softmax(logits, -1).cpu()


def _plain_continuation(model, ctx: list[int], cont: list[int]) -> float:
    """The summed log-probability of ``cont`` after ``ctx`` from one plain pass (no cache)."""
    with torch.no_grad():
        x = torch.tensor([ctx + cont], device=model.device)
        logits = model(input_ids=x, logits_to_keep=len(cont) + 1).logits[0, :-1].float()
    return float(torch.log_softmax(logits, -1).gather(1, x[0, len(ctx) :, None]).sum())


def _plain_greedy(model, tok, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids], device=model.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("dtype", "attn"), VANILLA_VARIANTS)
def test_vanilla_equals_plain_transformers_on_every_path(tok, prompts, family, dtype, attn):
    model = tiny_family_model(family, tok, dtype, attn, device=DEVICE)
    backend = backend_spec("vanilla").resolve()(model, tok)
    ids = [backend.encode(p) for p in prompts]
    assert min(map(len, ids)) > TINY_WINDOW  # the sliding layers' windows fill
    want = torch.stack([_plain_logprobs(model, x) for x in ids])
    got = backend.next_token_logprobs(prompts, batch_size=3).cpu()  # left padded
    assert (got - want).abs().max().item() < TOLERANCE[dtype]
    # log-probabilities are read from the logits in float32, whatever the model's dtype
    (first,) = backend.generate(prompts[:1], max_new_tokens=1, first_logprobs=True)
    assert got.dtype == first.first_logprobs.dtype == torch.float32
    assert (first.first_logprobs.cpu() - want[0]).abs().max().item() < TOLERANCE[dtype]
    if dtype == torch.float32:  # greedy tokens: bf16 rounding may flip a random model's argmax
        plain = [_plain_greedy(model, tok, x, 4) for x in ids]
        for size, reuse in ((3, False), (1, True), (3, True)):
            gens = backend.generate(prompts, batch_size=size, max_new_tokens=4, prefix_reuse=reuse)
            for g, p in zip(gens, plain, strict=True):
                assert g.token_ids == p[: len(g.token_ids)], (size, reuse)
        for reuse in (False, True):  # continuous batching: a row joins after each step
            dec, rows, done = backend.decoder(prefix_reuse=reuse), [], {}
            for p in prompts:
                rows.append(dec.add(p, max_new_tokens=4))
                done.update(dec.step())
            while len(dec):
                done.update(dec.step())
            for r, p in zip(rows, plain, strict=True):
                assert done[r].token_ids == p[: len(done[r].token_ids)], ("decoder", reuse)
    # candidate answers scored over the prefix cache (each context prefilled once, the cache
    # left by the calls above cropped back) equal one plain pass each
    pairs = [(p, c) for p in prompts[:2] for c in (" Paris", " 42 and more")]
    got = backend.loglikelihood(pairs)
    for (p, c), value in zip(pairs, got, strict=True):
        cont = backend.tokenize(c)
        want = _plain_continuation(model, backend.encode(p), cont)
        assert abs(value - want) < TOLERANCE[dtype] * len(cont), (p, c)
    # echo scoring (what ragfix serve answers): rows shared with the call before are reused
    for p, c in pairs:
        x = backend.encode(p) + backend.tokenize(c)
        got, want = backend.token_scores(x, 3), backend.token_scores_ids(x, 3)
        assert (got.logprobs - want.logprobs).abs().max().item() < TOLERANCE[dtype]
        assert got.top_ids.shape == want.top_ids.shape == (len(x) - 1, 3)


#: a method at its neutral setting reads the prompt as the plain model does
NEUTRAL = {
    "pine": {},  # one passage: nothing to re-rank, positions as read
    "set-based": {},  # one passage: the set is the sequence
    "calibrated-attention": {},  # one passage keeps all the passages' mass
    "attention-sort": {},  # one passage: nothing to sort
    "channel-scaled": {"channel": 3, "factor": 1.0},
    "gali": {},  # a prompt inside the trained window runs as the model
    "truncated": {},  # a prompt inside the window is not cut
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("dtype", "attn"), VARIANTS)
def test_every_method_at_its_neutral_setting_equals_the_plain_model(tok, family, dtype, attn):
    model = tiny_family_model(family, tok, dtype, attn, device=DEVICE)
    prompt = _one_passage_prompt()
    ran = []
    for name, options in NEUTRAL.items():
        cls = backend_spec(name).resolve()
        if verdict(name, model.config, options) is not None:
            with pytest.raises(UnsupportedModelError):
                cls(model, tok, **options)
            continue
        backend = cls(model, tok, **options)
        ids = backend.encode(prompt)
        assert len(ids) > TINY_WINDOW
        got = backend.next_token_logprobs([prompt])[0].cpu()
        want = _plain_logprobs(model, ids)
        assert (got - want).abs().max().item() < TOLERANCE[dtype], name
        if dtype == torch.float32:
            answer = backend.generate([prompt], max_new_tokens=3)[0]
            assert answer.token_ids == _plain_greedy(model, tok, ids, 3)[: answer.new_tokens]
        if hasattr(backend, "scaling"):
            backend.scaling.remove()
        ran.append(name)
    assert ran  # at least pine, set-based, calibrated-attention and attention-sort


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("dtype", "attn"), VARIANTS[::3])
@pytest.mark.parametrize("name", ["pine", "set-based"])
def test_order_invariance_on_every_family(tok, family, dtype, attn, name):
    from ragfix.bundled import resolve_data
    from ragfix.connectors.litm import load_samples
    from ragfix.tasks import task_prompt

    model = tiny_family_model(family, tok, dtype, attn, device=DEVICE)
    backend = backend_spec(name).resolve()(model, tok)
    sample = load_samples(resolve_data("kv-sample"), 8, 1)[0]
    moved = [task_prompt(sample, sample.passages_with_gold_at(p)) for p in (0, 4, 7)]
    lp = backend.next_token_logprobs(moved, batch_size=3)
    assert (lp - lp[0]).abs().max().item() < INVARIANCE[dtype]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("dtype", "attn"), VARIANTS[::3])
def test_order_marginalization_on_every_family(tok, family, dtype, attn):
    """Each vote is vanilla's own answer on that order (one prompt at a time); over the prefix
    cache and one batched decode (a sliding window's keys all kept) the votes are the same in
    fp32, and in bf16 the wrapper runs and keeps one of its votes."""
    from ragfix.backends.orders import OrderOptions, marginalize_orders
    from ragfix.bundled import resolve_data
    from ragfix.connectors.litm import load_samples
    from ragfix.tasks import task_prompt

    model = tiny_family_model(family, tok, dtype, attn, device=DEVICE)
    backend = backend_spec("vanilla").resolve()(model, tok)
    wrapped = marginalize_orders(backend, OrderOptions(orders=3, aggregate="plurality"))
    sample = load_samples(resolve_data("kv-sample"), 8, 1)[0]
    prompt = task_prompt(sample, sample.passages_with_gold_at(4))
    one = wrapped.generate([prompt], batch_size=1, max_new_tokens=4)[0]
    orders = [prompt.reordered(v["order"]) for v in one.votes]
    alone = backend.generate(orders, batch_size=1, max_new_tokens=4)
    assert [v["answer"] for v in one.votes] == [g.text for g in alone]
    reused = wrapped.generate([prompt], batch_size=3, max_new_tokens=4, prefix_reuse=True)[0]
    assert reused.text in [v["answer"] for v in reused.votes] and len(reused.votes) == 3
    if dtype == torch.float32:
        assert [v["answer"] for v in reused.votes] == [g.text for g in alone]


@pytest.mark.parametrize("family", FAMILIES)
def test_refusals_come_from_the_config_before_any_weights(tmp_path, tok, family):
    """A model folder with only its config and tokenizer: every refusing backend refuses in one
    line naming the family (the weights, absent, are never read); every other backend gets past
    the check to the missing weights."""
    cfg = tiny_config(
        family,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    name = read_family(cfg).name
    for backend in probed_backends():
        reason = verdict(backend, cfg)
        options = {"channel": 3} if backend == "channel-scaled" else {}
        if reason is None:
            with pytest.raises(Exception) as e:
                load_backend(backend, model=str(tmp_path), device="cpu", **options)
            assert not isinstance(e.value, UnsupportedModelError)
            continue
        with pytest.raises(UnsupportedModelError) as e:
            load_backend(backend, model=str(tmp_path), device="cpu", **options)
        assert str(e.value) == reason
        assert "\n" not in reason and name in reason and reason.startswith(backend)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_cell_of_the_capability_table_is_what_the_backends_do(tok, prompts, family):
    """The committed table (``ragfix bench families --json results/capabilities.json``) against
    the backends now: a cell refused from the config has the config's verdict; a refusing cell
    refuses on the tiny model with the same line (from the config, or on the probe prompts:
    attention-sort where every layer's window is shorter than the prompt); a working cell runs
    every path (fp32, sdpa; bf16 and eager are the neutral-setting test's)."""
    table = json.loads((ROOT / "results" / "capabilities.json").read_text())
    cells = table["cells"][family]
    assert sorted(cells) == sorted(probed_backends())
    for backend, cell in cells.items():
        config_reason = verdict(backend, tiny_config(family))
        if config_reason is not None:
            assert cell["reason"] == config_reason, backend
        model = tiny_family_model(family, tok, torch.float32, "sdpa", device=DEVICE)
        if cell["works"]:
            probe_cell(backend, model, tok, prompts)
        else:
            with pytest.raises(UnsupportedModelError) as e:
                probe_cell(backend, model, tok, prompts)
            assert str(e.value) == cell["reason"], backend


def test_gemma3_270m_is_checked_from_its_gguf_and_reads_the_completion_form():
    """The second real model (Gemma 3 270M base, from its chunk wheels): its family and verdicts
    from the GGUF's config, and a KV answer in the task's completion form (no chat template)."""
    from conftest import data_file

    from ragfix.connectors.litm import load_samples
    from ragfix.eval.families import check_model
    from ragfix.prompts import NO_CHAT_TEMPLATE
    from ragfix.tasks import score_answer, task_prompt

    family, verdicts = check_model("gemma3-270m")
    assert family.model_type == "gemma3_text" and family.sliding
    assert {b for b, reason in verdicts if reason} == {"gali", "rope-scaled"}
    backend = load_backend("vanilla", model="gemma3-270m")
    assert backend.identity()["chat_template"] == NO_CHAT_TEMPLATE
    sample = load_samples(data_file("litm_kv_retrieval_140_keys.jsonl.gz"), 8, 3)[2]
    prompt = task_prompt(sample, sample.passages_with_gold_at(0))
    assert backend.format_prompt(prompt).endswith('\nCorresponding value: "')
    # the tokens are those Hugging Face's own call gives the text: Gemma's BOS first (a text
    # without it is answered as if by another model); a string too, its BOS never doubled
    text = prompt.user + prompt.answer_prefix(chat=False)
    assert backend.encode(prompt) == backend.tokenizer(text)["input_ids"]
    assert backend.encode(prompt)[0] == backend.tokenizer.bos_token_id
    assert backend.format_prompt("Paris") == backend.format_prompt("<bos>Paris") == "<bos>Paris"
    [answer] = backend.generate([prompt])
    assert answer.text.startswith(sample.answers[0]) and score_answer(sample, answer.text)


@pytest.mark.parametrize("family", FAMILIES)
def test_served_scores_equal_the_local_ones_on_every_family(tok, family):
    """Issue 55, item 2: each family's tiny model served by ``ragfix serve`` and read through a
    remote backend (completions ``echo``, read by token count) gives the local log-likelihoods:
    ASCII, text the vocabulary splits into bytes, and a context of about 400 tokens (past the
    tiny sliding window)."""
    from test_serve import running

    from ragfix.serve import create_app

    model = tiny_family_model(family, tok, torch.float32, "sdpa", device=DEVICE)
    local = backend_spec("vanilla").resolve()(model, tok)
    long = _one_passage_prompt().user
    pairs = [
        ("The capital of France is", " Paris"),
        ("Le prix est de 100 ₹, soit", " un euro"),
        (long, " The answer is Paris"),
    ]
    with running(create_app(local, "tiny")) as url:
        remote = load_backend("vanilla", model="openai:tiny", api_base=url + "/v1")
        served = remote.loglikelihood(pairs)
    assert served == pytest.approx(local.loglikelihood(pairs), abs=TOLERANCE[torch.float32])
