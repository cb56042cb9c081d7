"""GALI backend (arXiv 2502.02659) and the RoPE-scaling baselines: position IDs, the interpolated
attention against a direct two-matrix reference, blocking, noise, and real SmolLM2 checks."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from conftest import (
    BUNDLED,
    data_file,
    fractional_queries,
    gali_query_positions,
    random_ids,
    tiny_model,
)
from pydantic import ValidationError
from transformers.models.llama.modeling_llama import repeat_kv

from ragfix.backends import backend_names, load_backend
from ragfix.backends.gali import (
    GaliBackend,
    chunk_sizes,
    default_chunk_size,
    gali_layout,
    gali_positions,
    paper_logits,
    paper_setting,
)
from ragfix.backends.hf import HFBackend
from ragfix.backends.rope_scaled import RopeScaledBackend
from ragfix.backends.truncated import TruncatedBackend, truncate_middle
from ragfix.errors import UnsupportedModelError
from ragfix.prompts import TaskPrompt

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
BUNDLED_KV = BUNDLED / "kv_16pairs_sample.jsonl.gz"


def _vanilla_logprobs(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(x).logits[0].float(), dim=-1)[:-1]
    return logp.gather(1, x[0, 1:, None]).squeeze(1)


@torch.no_grad()
def _reference_logprobs(
    model, ids: list[int], big_l: int, w: int, s: int, window: int | None = None
) -> torch.Tensor:
    """GALI written out directly: chunk loop, whole-sequence positions per chunk, pre-RoPE cache,
    the paper's two logit matrices (:func:`paper_logits`) per layer, repeat_kv for GQA; with
    ``window``, every layer also hides keys at a distance ``ceil(p_q) - p_k >= window``."""
    dec = model.get_decoder()
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out, done = [], 0
    for size in chunk_sizes(len(ids), big_l, s):
        layout = gali_layout(done + size, big_l, w)
        h = dec.embed_tokens(torch.tensor([ids[done : done + size]]))
        for i, layer in enumerate(dec.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (1, size, -1, a.head_dim)
            q, k = a.q_proj(x).view(shape), a.k_proj(x).view(shape)
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = a.v_proj(x).view(shape).transpose(1, 2)
            if i in cache:
                k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
            cache[i] = (k, v)
            g = a.num_key_value_groups
            logits = paper_logits(q, repeat_kv(k, g), layout, dec.rotary_emb, a.scaling, done)
            future = torch.arange(done + size)[None, :] > torch.arange(done, done + size)[:, None]
            if window is not None:
                distance = layout.ceil[done:, None].double() - layout.positions[None, :]
                future = future | (distance >= window)
            probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
            o = (probs @ repeat_kv(v, g)).transpose(1, 2).reshape(1, size, -1)
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append(torch.log_softmax(model.lm_head(dec.norm(h))[0].float(), dim=-1))
        done += size
    logp = torch.cat(out)[:-1]
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def tok(smol):
    return smol.tokenizer


# ---------------------------------------------------------------- position IDs and chunks
def test_positions_worked_example():
    assert gali_positions(10, 8, 2).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 5, 6, 7]


def test_positions_paper_scale():
    # L=8192, W=128, T=16000: g = 2 and a 384-token integer tail ending at L-1
    lay = gali_layout(16000, 8192, 128)
    pos = lay.positions
    assert len(pos) == 16000 and pos[-1] == 8191 and pos.max() < 8192
    tail = int((lay.frac == 0).flip(0).cumprod(0).sum())  # trailing integer run incl. 7808 -> 8191
    assert tail >= 384 and pos[-384] == 8192 - 384
    assert torch.equal(pos[-384:], torch.arange(7808, 8192, dtype=torch.float64))
    assert pos[1] == 0.5  # head compressed with step 1/g = 1/2


@pytest.mark.parametrize("total", [9, 17, 40, 100, 333])
def test_positions_invariants(total):
    lay = gali_layout(total, 8, 2)
    p = lay.positions
    assert p[-1] == 7 and torch.all(p[1:] > p[:-1]) and p[0] == 0
    assert torch.allclose(lay.ceil.double() - lay.frac, p, rtol=0, atol=1e-12)
    assert torch.equal(lay.floor, torch.floor(p).long())
    # at least W = 2 most recent tokens keep unit spacing
    assert torch.equal(p[-2:], torch.tensor([6.0, 7.0], dtype=torch.float64))


def test_positions_within_window_and_errors():
    assert gali_positions(5, 8, 2).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="local_window"):
        gali_layout(20, 8, 8)


def test_chunk_sizes():
    assert chunk_sizes(10, 4, 3) == [4, 3, 3]
    assert chunk_sizes(12, 4, 3) == [4, 3, 3, 2]
    assert chunk_sizes(4, 4, 3) == [4]


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("arch", ARCHS)
def test_within_window_equals_vanilla(arch, tok):
    model = tiny_model(arch, seed=0)
    b = GaliBackend(model, tok, train_window=256, query_block=7)
    ids = random_ids(60)
    assert torch.allclose(b.token_logprobs(ids), _vanilla_logprobs(model, ids), atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_beyond_window_equals_direct_reference(arch, tok):
    model = tiny_model(arch, seed=0)
    b = GaliBackend(model, tok, train_window=16, chunk_size=5, local_window=3, noise=False)
    ids = random_ids(57)
    got = b.token_logprobs(ids)
    ref = _reference_logprobs(model, ids, 16, 3, 5)
    assert torch.allclose(got, ref, atol=1e-5)
    # and GALI is not the vanilla model beyond L
    assert (got - _vanilla_logprobs(model, ids)).abs().max() > 1e-3


def test_sliding_window_follows_gali_positions(tok):
    """Mistral with an 8-token window: within L the model's own window (vanilla), beyond L the
    window over GALI's positions, as the direct reference computes it."""
    model = tiny_model("mistral", seed=0, sliding_window=8)
    ids = random_ids(57)
    inside = GaliBackend(model, tok, train_window=256, query_block=7)
    assert torch.allclose(inside.token_logprobs(ids), _vanilla_logprobs(model, ids), atol=1e-5)
    b = GaliBackend(model, tok, train_window=16, chunk_size=5, local_window=3, noise=False)
    got = b.token_logprobs(ids)
    assert torch.allclose(got, _reference_logprobs(model, ids, 16, 3, 5, window=8), atol=1e-5)
    assert (got - _reference_logprobs(model, ids, 16, 3, 5)).abs().max() > 1e-3


def test_paper_logits_are_the_key_interpolation():
    # frac depends on the key only, so A_lo + frac (A_hi - A_lo) = q_c . lerp(k_c, k_f, frac)
    model = tiny_model("llama", seed=0)
    rot = model.get_decoder().rotary_emb
    lay = gali_layout(30, 8, 2)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 4, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    got = paper_logits(q, k, lay, rot, 0.25, 26)
    cos_c, sin_c = rot(q, lay.ceil[None])
    cos_f, sin_f = rot(q, lay.floor[None])

    def rope(x, c, s):
        return x * c + torch.cat((-x[..., 8:], x[..., :8]), -1) * s

    kk = torch.lerp(
        rope(k, cos_c[0], sin_c[0]), rope(k, cos_f[0], sin_f[0]), lay.frac[:, None].float()
    )
    ref = rope(q, cos_c[0, 26:], sin_c[0, 26:]) @ kk.transpose(-1, -2) * 0.25
    assert torch.allclose(got, ref, atol=1e-5)


def test_blocked_equals_unblocked(tok):
    model = tiny_model("qwen2", seed=3)
    ids = random_ids(70, seed=4)
    opts = dict(train_window=16, chunk_size=9, local_window=2, noise=False)
    blocked = GaliBackend(model, tok, query_block=3, **opts).token_logprobs(ids)
    whole = GaliBackend(model, tok, query_block=None, **opts).token_logprobs(ids)
    assert torch.allclose(blocked, whole, atol=1e-5)


def test_noise_off_deterministic_noise_seeded(tok):
    model = tiny_model("llama", seed=0)
    ids = random_ids(50)
    base = dict(train_window=16, chunk_size=6, local_window=2)
    off = GaliBackend(model, tok, noise=False, **base)
    assert torch.equal(off.token_logprobs(ids), off.token_logprobs(ids))
    s0 = GaliBackend(model, tok, noise=True, seed=0, **base)
    a, b = s0.token_logprobs(ids), s0.token_logprobs(ids)
    assert torch.equal(a, b)  # same seed, same noise
    c = GaliBackend(model, tok, noise=True, seed=1, **base).token_logprobs(ids)
    assert not torch.equal(a, c)
    assert not torch.equal(a, off.token_logprobs(ids))
    # noise only touches logits beyond the window: the first chunk (L tokens) is unchanged
    assert torch.equal(a[:15], off.token_logprobs(ids)[:15])


def test_generate_batch_matches_single(tok):
    model = tiny_model("llama", seed=0)
    b = GaliBackend(model, tok, train_window=16, chunk_size=6, noise=False)
    p1, p2, p3 = random_ids(30, 1), random_ids(30, 2), random_ids(23, 3)
    batch = b.generate_ids([p1, p2, p3], 5, False)
    singles = [b.generate_ids([p], 5, False)[0] for p in (p1, p2, p3)]
    assert [g.text for g in batch] == [g.text for g in singles]
    assert all(
        g.new_tokens == 5 and g.prefill_tokens == len(p)
        for g, p in zip(batch, (p1, p2, p3), strict=True)
    )


def test_decode_steps_equal_chunked_prefill(tok):
    # with chunk_size=1 a prefill beyond L feeds one token per step, exactly like decoding: the
    # greedy continuation of ids + [t1] must be t2, t3, ... (positions recomputed every step)
    model = tiny_model("llama", seed=0)
    b = GaliBackend(model, tok, train_window=16, chunk_size=1, local_window=2, noise=False)
    ids = torch.tensor([random_ids(20)])
    toks = [t[0] for t, _, _ in b._greedy(ids, 4, stop_at_newline=False)]
    again = [t[0] for t, _, _ in b._greedy(torch.cat([ids, torch.tensor([toks[:1]])], 1), 3, False)]
    assert again == toks[1:]


def test_errors(tok):
    with pytest.raises(ValueError, match="exceeds the model's trained window"):
        GaliBackend(tiny_model("llama"), tok, train_window=1000)
    with pytest.raises(ValueError, match="local_window"):
        GaliBackend(tiny_model("llama"), tok, train_window=16, local_window=16)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match=r"gali does not support gpt2 \(gpt2\)"):
        GaliBackend(gpt2, tok)


# ---------------------------------------------------------------- real SmolLM2
def _essay_ids(tok, n: int) -> list[int]:
    with gzip.open(data_file("needle_paul_graham_essays.jsonl.gz"), "rt") as f:
        text = json.loads(f.readline())["text"]
    return tok(text, add_special_tokens=False)["input_ids"][:n]


def test_smollm2_within_window_is_vanilla(smol):
    g = GaliBackend(smol.model, smol.tokenizer, train_window=512)
    prompt = TaskPrompt(user="What is the capital of France? Answer in one word.")
    assert torch.equal(g.next_token_logprobs([prompt]), smol.next_token_logprobs([prompt]))
    assert g.generate([prompt])[0].text == smol.generate([prompt])[0].text
    assert g.context_window == 2048 and smol.context_window == 8192


def test_smollm2_beyond_window_perplexity(smol):
    # at 2x a lowered window (L=128), GALI's perplexity stays near the model's own at full
    # positions (SmolLM2 was trained to 8192, so vanilla here is the in-window reference)
    ids = _essay_ids(smol.tokenizer, 256)
    g = GaliBackend(smol.model, smol.tokenizer, train_window=128)
    ppl_g = torch.exp(-g.token_logprobs(ids).mean()).item()
    ppl_v = torch.exp(-_vanilla_logprobs(smol.model, ids).mean()).item()
    ppl_in = torch.exp(-_vanilla_logprobs(smol.model, ids[:128]).mean()).item()
    assert ppl_g < 1.25 * ppl_v
    assert ppl_g < ppl_in  # more context still helps under GALI


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_rope_scaled_baselines(rope_type, tok):
    model = tiny_model("llama", seed=0)
    ids = random_ids(40)
    ref = _vanilla_logprobs(model, ids)
    b = RopeScaledBackend(model, tok, rope_type=rope_type, factor=4, train_window=16)
    assert b.context_window == 64
    got = _vanilla_logprobs(b.model, ids)
    assert (got[16:] - ref[16:]).abs().max() > 1e-4
    if rope_type == "dynamic":  # dynamic NTK leaves sequences within the window unchanged
        assert torch.allclose(_vanilla_logprobs(b.model, ids[:12]), ref[:11], atol=1e-5)


def test_rope_scaled_bad_option():
    with pytest.raises(ValidationError, match="rope_type"):
        load_backend("rope-scaled", rope_type="bogus")


# ---------------------------------------------------------------- truncated baseline
def test_truncate_middle():
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert truncate_middle([1, 2], 5) == [1, 2]
    with pytest.raises(ValueError, match="budget"):
        truncate_middle([1], 0)


def test_truncated_backend_reads_the_cut_prompt(tok):
    model = tiny_model("llama", seed=0)
    t = TruncatedBackend(model, tok, train_window=24)
    ids = random_ids(40)
    got = t.generate_ids([ids], 4, False, first_logprobs=True)[0]
    cut = truncate_middle(ids, 20)
    ref = t.generate_ids([cut], 4, False, first_logprobs=True)[0]
    assert got.text == ref.text and got.prompt_tokens == 40 and got.prefill_tokens == 20
    # the first-step log-probs (a judge's letter probabilities) come from the same cut prompt
    assert torch.equal(got.first_logprobs, ref.first_logprobs)
    assert t.context_window == 24 and not t.supports_prefix_reuse


def test_gali_first_logprobs_beyond_window_equal_next_token_logprobs(tok):
    model = tiny_model("llama", seed=0)
    b = GaliBackend(model, tok, train_window=16, chunk_size=6, noise=False)
    ids = random_ids(30, 4)
    [gen] = b.generate_ids([ids], 3, False, first_logprobs=True)
    torch.testing.assert_close(gen.first_logprobs, b.next_logprobs_ids([ids])[0])


# ---------------------------------------------------------------- query positions of a scored text
@pytest.mark.parametrize("n,big_l,w,s", [(57, 16, 3, 5), (40, 16, 2, 16), (16, 16, 2, 5)])
def test_token_logprobs_with_positions(tok, n, big_l, w, s):
    model = tiny_model("llama", seed=0)
    b = GaliBackend(model, tok, train_window=big_l, chunk_size=s, local_window=w, noise=False)
    ids = random_ids(n)
    logp, pos = b.token_logprobs_with_positions(ids)
    assert torch.equal(logp, b.token_logprobs(ids))
    # token t is predicted from query t - 1, at the position its chunk gave it
    assert pos.tolist() == gali_query_positions(n, big_l, w, s)[:-1]
    fractional = sum(p != int(p) for p in pos.tolist())
    assert (fractional > 0) == (n > big_l)  # past L these lengths reach the compressed head
    assert pos.max() <= big_l - 1


def test_query_positions_at_the_reviewed_setting():
    # SmolLM2 at L = 512, 4 L = 2048 tokens, the paper's setting scaled to L (chunk 187, W = 8):
    # 405 of the 2047 predicted tokens come from a query at a fractional position; with chunks
    # of 64, 70
    assert paper_setting(512) == {"chunk_size": 187, "local_window": 8}
    assert fractional_queries(2048, 512, 8, 187) == 405
    assert fractional_queries(2048, 512, 8, 64) == 70


@pytest.mark.parametrize("big_l", [64, 256, 512, 1024, 8192])
def test_default_chunk_leaves_no_query_interpolated(big_l):
    """The default: chunk ``s = L / 8`` and local window ``W = s``. With ``s <= W`` the integer
    tail of the positions (never shorter than W) holds every query of a chunk, up to 4 L; a
    chunk longer than W leaves some queries in the compressed head."""
    s = default_chunk_size(big_l)
    assert s == max(1, round(big_l / 8))
    assert fractional_queries(4 * big_l, big_l, s, s) == 0
    assert fractional_queries(4 * big_l, big_l, s // 2, s) > 0


def test_default_setting_in_every_entry_point(smol, tmp_path):
    """GALI's defaults (chunk L / 8, local window = chunk) are what each entry point runs:
    the Python API (``load_backend`` and the class), ``ragfix eval``'s run config and
    ``ragfix serve``'s model identity (``eval-ppl``: tests/test_ppl.py; ``bench gali``:
    test_bench_gali_runs); an explicit chunk keeps its own local window default, capped at
    ``L - 1``."""
    from typer.testing import CliRunner

    from ragfix.cli.app import app
    from ragfix.serve import serving

    expected = {"train_window": 512, "target_window": 2048, "chunk_size": 64, "local_window": 64}

    def resolved(identity: dict) -> dict:
        return {k: identity["options"][k] for k in expected}

    api = GaliBackend(smol.model, smol.tokenizer, train_window=512)
    assert resolved(api.identity()) == expected
    loaded = load_backend("gali", device="cpu", train_window=512)
    assert resolved(loaded.identity()) == expected
    wide = GaliBackend(smol.model, smol.tokenizer, train_window=64, chunk_size=100)
    assert wide.options_resolved["local_window"] == 63
    out = tmp_path / "run"
    args = ["eval", str(BUNDLED_KV), "--backend", "gali", "--train-window", "512"]
    args += ["--num-docs", "2", "--positions", "first", "--limit", "1", "--device", "cpu"]
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert resolved(json.loads((out / "config.json").read_text())["identity"]) == expected
    serve = ["--model", "smollm2", "--backend", "gali", "--train-window", "512"]
    with serving(*serve, "--device", "cpu") as url:
        import httpx

        [info] = httpx.get(f"{url}/models").json()["data"]
    assert resolved(info["ragfix"]) == expected


def test_prefill_logits_is_the_last_row_of_the_scored_text(tok):
    # 34 = L + 3 chunks of 6: scoring ids + [7] adds a chunk of its own, so the query of the
    # last token of ids is computed exactly as in the prefill of ids alone
    model = tiny_model("qwen2", seed=1)
    b = GaliBackend(model, tok, train_window=16, chunk_size=6, local_window=2, noise=False)
    ids = random_ids(34, 2)
    last = torch.log_softmax(b.prefill_logits(ids).float(), dim=-1)[7]
    assert torch.allclose(last, b.token_logprobs(ids + [7])[-1], atol=1e-5)


# ---------------------------------------------------------------- truncated: scoring a long text
def _context_logprob(model, ids: list[int], t: int, c: int) -> float:
    """``log p(ids[t] | ids[t - c : t])`` read as a sequence of its own (positions 0..c)."""
    with torch.no_grad():
        x = torch.tensor([ids[t - c : t + 1]])
        return torch.log_softmax(model(x).logits[0, -2].float(), dim=-1)[ids[t]].item()


@pytest.mark.parametrize("stride", [1, 3])
def test_truncated_scores_each_token_within_the_window(tok, stride):
    model = tiny_model("llama", seed=0)
    big_l, n = 12, 12 + 9 * stride  # targets L..n-1: the last window scores `stride` of them
    t = TruncatedBackend(model, tok, train_window=big_l, score_stride=stride)
    ids = random_ids(n)
    got = t.token_logprobs(ids)
    # token t >= L lies in the window ending at b = L + stride * ceil((t - L + 1) / stride)
    contexts = [tt if tt < big_l else big_l - stride + (tt - big_l) % stride for tt in range(1, n)]
    ref = [_context_logprob(model, ids, tt, c) for tt, c in zip(range(1, n), contexts, strict=True)]
    assert torch.allclose(got, torch.tensor(ref), atol=1e-5)
    assert max(contexts) == big_l - 1 and min(contexts[big_l - 1 :]) == big_l - stride
    # within the window: the plain model; beyond it, not
    full = _vanilla_logprobs(model, ids)
    assert torch.allclose(got[: big_l - 1], full[: big_l - 1], atol=1e-6)
    assert (got[big_l:] - full[big_l:]).abs().max() > 1e-3


def test_truncated_score_stride_default_and_error(tok):
    model = tiny_model("llama", seed=0)
    assert TruncatedBackend(model, tok, train_window=512).score_stride == 128
    with pytest.raises(ValueError, match="score_stride 12 must be < train_window 12"):
        TruncatedBackend(model, tok, train_window=12, score_stride=12)


# ---------------------------------------------------------------- the benchmark still runs
def test_bench_gali_runs(tmp_path):
    from typer.testing import CliRunner

    from ragfix.cli.app import app

    out = tmp_path / "bench.json"
    args = ["bench", "gali", "--train-window", "64", "--ratios", "1,2", "--attn-tokens", "96"]
    args += ["--attn-chunk", "16", "--chunk-size", "16", "--local-window", "4"]
    args += ["--data", str(data_file("needle_paul_graham_essays.jsonl.gz")), "--json", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "One layer's attention, last chunk of 96 tokens" in res.output
    result = json.loads(out.read_text())  # a benchmark result file: the prefill table, rendered
    rows = result["measurements"]
    prefill = [r for r in rows if r["kind"] == "prefill"]
    assert [r["tokens"] for r in prefill] == [64, 128]
    assert all(r["vanilla_s"] > 0 and r["gali_s"] > 0 for r in prefill)
    attn = [r for r in rows if r["kind"] == "attention"]
    assert [(r["tokens"], r["chunk"], r["query_block"]) for r in attn] == [
        (96, 16, 256),
        (96, 16, 32),
    ]
    assert "chunk 16, local window 4" in result["title"] and result["options"]["chunk_size"] == 16
    # the paper's setting beside it, scaled to L = 64: chunk 23, local window 1
    assert "paper's setting: chunk 23, local window 1" in result["title"]
    assert result["paper_options"]["chunk_size"] == 23
    assert [row[:2] for row in result["rows"]] == [["64", "1"], ["128", "2"]]
    # forward passes of the chunked prefill: [64] and [64, 16 x 4] / [64, 23, 23, 18]
    assert [(r["gali_passes"], r["paper_passes"]) for r in prefill] == [(1, 1), (5, 4)]
    assert all(r["paper_s"] > 0 for r in prefill)


@pytest.mark.parametrize("name", ["truncated", "gali"])
def test_a_streamed_answer_beyond_the_window_reads_what_a_generated_one_reads(tok, name):
    # the streamed answer of a prompt longer than the window: the cut prompt (truncated), GALI's
    # positions (gali); before stream_ids, HFBackend.stream read the whole prompt as vanilla
    model = tiny_model("llama", seed=0)
    cls = {"truncated": TruncatedBackend, "gali": GaliBackend}[name]
    gali = {"chunk_size": 6, "noise": False} if name == "gali" else {}
    b = cls(model, tok, train_window=16, **gali)
    ids = random_ids(40, 5)
    [want] = b.generate_ids([ids], 6, False)
    got = "".join(b.stream_ids(ids, 6, False))
    assert got.strip() == want.text.strip()
    if name == "truncated":  # the cut changes the answer: reading the whole prompt would show
        plain = HFBackend(model, tok).generate_ids([ids], 6, False)[0]
        assert got.strip() != plain.text.strip()


def test_every_backend_that_runs_the_model_its_own_way_streams_that_way():
    from ragfix.backends import backend_spec

    for name in backend_names():
        cls = backend_spec(name).resolve()
        if not issubclass(cls, HFBackend):
            continue
        for hook in ("generate_ids", "next_logprobs_ids", "token_scores_ids"):
            if getattr(cls, hook) is not getattr(HFBackend, hook):
                assert cls.stream_ids is not HFBackend.stream_ids or (
                    cls.stream is not HFBackend.stream
                ), (name, hook)
