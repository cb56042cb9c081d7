"""ragfix's SDPA forms (ragfix.models.attention): float32 decode steps, and banded prefill of
sliding-window layers, each checked against attention computed by hand in float64 and chosen
by load_model on the CPU only (bf16; sliding-window models)."""

import json
import math

import pytest
import torch
from conftest import run_records, tiny_folder
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import ragfix.models.attention as attention
from ragfix.backends.hf import HFBackend
from ragfix.models.attention import BAND_ROWS, sdpa_banded, sdpa_fp32_decode
from ragfix.models.device import SDPA_BANDED, SDPA_FP32_DECODE, default_attention
from ragfix.models.load import load_model


class _Heads(torch.nn.Module):
    """The attributes transformers' attention functions read from the attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def by_hand(query, key, value, mask, scaling):
    """softmax(q k^T * scaling + mask) v in float64, grouped-query heads repeated, a boolean mask
    read as True = attend; returns (batch, q_len, heads, head_dim)."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _inputs(q_len: int, kv_len: int = 37, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, q_len, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, kv_len, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, kv_len, 16, generator=g).to(dtype)
    mask = torch.ones(2, 1, q_len, kv_len, dtype=torch.bool)
    mask[0, :, :, :5] = False  # the first row is left-padded by 5 tokens
    return q, k, v, mask


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_a_bf16_decode_step_is_the_float32_attention_rounded_once(mask_kind):
    q, k, v, mask = _inputs(1)
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape, dtype=torch.bfloat16).masked_fill(~mask, -1e30)
    elif mask_kind == "none":
        mask = None
    scaling = 16**-0.5
    out, weights = sdpa_fp32_decode(_Heads(2), q, k, v, mask, scaling=scaling, dropout=0.0)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 1, 4, 16) and weights is None
    exact = by_hand(q, k, v, mask.double() if mask_kind == "additive" else mask, scaling)
    # one rounding to bf16 of a float32 result: within half a bf16 ulp (unit roundoff 2^-8) of the
    # float64 attention, plus float32's own error
    assert torch.allclose(out.double(), exact, rtol=2**-8 + 1e-6, atol=1e-6)
    # bf16's own kernel on the same inputs is further from the exact value
    plain, _ = sdpa_attention_forward(_Heads(2), q, k, v, mask, scaling=scaling, dropout=0.0)
    assert (out.double() - exact).abs().mean() <= (plain.double() - exact).abs().mean()


def test_prefill_rows_and_float32_go_to_sdpa_unchanged():
    for q_len, dtype in ((6, torch.bfloat16), (1, torch.float32)):
        q, k, v, mask = _inputs(q_len, dtype=dtype)
        mask = mask & torch.ones(q_len, 37, dtype=torch.bool).tril(37 - q_len)
        ours, _ = sdpa_fp32_decode(_Heads(2), q, k, v, mask, scaling=0.25, dropout=0.0)
        plain, _ = sdpa_attention_forward(_Heads(2), q, k, v, mask, scaling=0.25, dropout=0.0)
        assert ours.dtype == dtype and torch.equal(ours, plain)


def _by_hand_decode(module, query, key, value, attention_mask, scaling=None, **kwargs):
    if query.shape[2] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    out = by_hand(query, key, value, attention_mask, scaling)
    return out.to(query.dtype), None


AttentionInterface.register("ragfix_test_by_hand", _by_hand_decode)
AttentionMaskInterface.register("ragfix_test_by_hand", sdpa_mask)


@pytest.mark.parametrize("arch, window", [("llama", None), ("mistral", 6)])
def test_bf16_models_on_the_cpu_decode_with_float32_steps_and_say_so(tmp_path, arch, window):
    folder = tiny_folder(tmp_path / arch, arch=arch)
    if window:  # Mistral's sliding window, shorter than the prompts
        import json

        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(cfg | {"sliding_window": window}))
    fp32, tok = load_model(str(folder), device="cpu", dtype="float32")
    bf16, _ = load_model(str(folder), device="cpu", dtype="bfloat16")
    hand, _ = load_model(
        str(folder), device="cpu", dtype="bfloat16", attn_implementation="ragfix_test_by_hand"
    )
    # a sliding-window model's SDPA is banded, its decode steps float32 all the same
    half = SDPA_BANDED if window else SDPA_FP32_DECODE
    assert fp32.config._attn_implementation == (SDPA_BANDED if window else "sdpa")
    assert bf16.config._attn_implementation == half
    assert HFBackend(fp32, tok).identity().get("attention") == (SDPA_BANDED if window else None)
    assert HFBackend(bf16, tok).identity()["attention"] == half
    prompts = ["a b c d e f g h i j", "one two three"]  # left-padded in one batch
    ours = HFBackend(bf16, tok).generate(prompts, max_new_tokens=8, stop_at_newline=False)
    ref = HFBackend(hand, tok).generate(prompts, max_new_tokens=8, stop_at_newline=False)
    assert [g.token_ids for g in ours] == [g.token_ids for g in ref]
    assert all(len(g.token_ids) == 8 for g in ours)


def test_runs_on_the_cpu_in_bf16_compute_each_cell_alone(tmp_path, monkeypatch):
    """A bf16 model on the CPU: a run's default batch is 1, whatever the kind's default (the
    sweep's 16 with prefix reuse, the judge's 4), an order-marginalized one too, and whatever
    device ``auto`` resolves to; float32 keeps the kind's default. A bf16 sweep computes its
    cells one at a time and answers as the sweep that computes each cell naively; the judge
    decodes each order of a pair alone."""
    from ragfix.backends import load_backend
    from ragfix.backends.orders import OrderOptions, marginalize_orders
    from ragfix.bundled import bundled_path
    from ragfix.eval import sweep_run
    from ragfix.eval.judge_run import run_judge
    from ragfix.eval.run import default_batch_size
    from ragfix.eval.sweep_run import run_sweep

    folder = str(tiny_folder(tmp_path / "tiny"))
    f32 = load_backend(model=folder, device="cpu", dtype="float32")
    bf16 = load_backend(model=folder, device="cpu", dtype="bfloat16")

    class Kind:  # a run kind whose own default is 16
        def batch_size(self, on_gpu: bool) -> int:
            return 16

    two_orders = marginalize_orders(bf16, OrderOptions(orders=2))
    assert [default_batch_size(b, "cpu", Kind()) for b in (f32, bf16, two_orders)] == [16, 1, 1]
    # a loaded backend is where its weights are, whatever device "auto" would pick
    assert default_batch_size(bf16, "cuda", Kind()) == 1
    sizes = []
    run_cells = sweep_run.run_cells

    def recording(*args, **kwargs):
        sizes.append(kwargs["batch_size"])
        return run_cells(*args, **kwargs)

    monkeypatch.setattr(sweep_run, "run_cells", recording)
    kv = bundled_path("kv-sample")
    sweep = dict(num_docs=4, positions="all", limit=2, workers=1)
    run_sweep(kv, tmp_path / "default", backend=bf16, **sweep)
    assert sizes == [1]
    run_sweep(kv, tmp_path / "naive", backend=bf16, batch_size=1, prefix_reuse=False, **sweep)
    default, naive = (
        {r["cell_id"]: r["answer"] for r in run_records(tmp_path / name)}
        for name in ("default", "naive")
    )
    assert len(default) == 8 and default == naive
    # the judge decodes each order of a pair alone
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"question": "What is 2 + 2?", "answer_a": "4", "answer_b": "5", "label": 1},
        {"question": "Capital of France?", "answer_a": "Rome", "answer_b": "Paris", "label": 2},
    ]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    generate, calls = bf16.generate, []

    def recorded(prompts, **kwargs):
        calls.append((len(prompts), kwargs["batch_size"]))
        return generate(prompts, **kwargs)

    monkeypatch.setattr(bf16, "generate", recorded)
    assert run_judge(pairs, tmp_path / "judge", backend=bf16).computed == 2
    assert calls == [(2, 1), (2, 1)]  # both orders of a pair in one call, decoded one at a time


def _band_calls(monkeypatch) -> list[tuple[int, int]]:
    """(query rows, keys) of every SDPA call ragfix.models.attention makes from now on."""
    calls: list[tuple[int, int]] = []

    def counted(module, query, key, *args, **kwargs):
        calls.append((query.shape[2], key.shape[2]))
        return sdpa_attention_forward(module, query, key, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted)
    return calls


@pytest.mark.parametrize("cached", [0, 100])
def test_banded_rows_are_the_sliding_window_attention_by_hand(monkeypatch, cached):
    """A sliding-window layer's prefill of 600 rows (after ``cached`` keys already in the
    cache, a left-padded row beside an unpadded one): each block of rows against its own
    keys, the same values as softmax by hand in float64 and as SDPA over every key."""
    rows, window, keys = 600, 100, 600 + cached
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, rows, 16, generator=g)
    k, v = (torch.randn(2, 2, keys, 16, generator=g) for _ in range(2))
    at = torch.arange(cached, keys)[:, None]  # each row's key index
    mask = ((torch.arange(keys) <= at) & (torch.arange(keys) > at - window))[None, None]
    mask = mask.repeat(2, 1, 1, 1)
    mask[0, :, :, :150] = False  # the first prompt left-padded by 150 tokens
    calls = _band_calls(monkeypatch)
    ours, _ = sdpa_banded(
        _Heads(2), q, k, v, mask, scaling=0.25, dropout=0.0, sliding_window=window
    )
    blocks = -(-rows // BAND_ROWS)
    assert len(calls) == blocks and all(n <= BAND_ROWS + window for _, n in calls)
    exact = by_hand(q, k, v, mask, 0.25)
    # rows whose every key is masked (the padding) are left out: SDPA's value there is its own
    live = mask.any(-1)[:, 0]  # (batch, rows)
    assert torch.allclose(ours.double()[live], exact[live], atol=1e-5)
    full, _ = sdpa_attention_forward(_Heads(2), q, k, v, mask, scaling=0.25, dropout=0.0)
    assert torch.allclose(ours[live], full[live], atol=1e-5)
    # a layer without a window, a short prefill and a decode step go to SDPA whole
    calls.clear()
    sdpa_banded(_Heads(2), q, k, v, mask, scaling=0.25, dropout=0.0, sliding_window=None)
    sdpa_banded(
        _Heads(2),
        q[:, :, :BAND_ROWS],
        k,
        v,
        mask[:, :, :BAND_ROWS],
        scaling=0.25,
        dropout=0.0,
        sliding_window=window,
    )
    assert calls == [(rows, keys), (BAND_ROWS, keys)]


def test_a_sliding_window_model_loads_banded_on_the_cpu_and_answers_as_sdpa(tmp_path, monkeypatch):
    """load_model picks the banded form for a model with sliding-window layers on the CPU (and
    only there); a 700-token prompt then prefills in blocks and answers as SDPA over every key:
    the same greedy tokens, last-token log-probs within float32 rounding."""
    folder = tiny_folder(tmp_path / "mistral", arch="mistral")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"sliding_window": 64}))
    banded, tok = load_model(str(folder), device="cpu", dtype="float32")
    plain, _ = load_model(str(folder), device="cpu", dtype="float32", attn_implementation="sdpa")
    assert banded.config._attn_implementation == SDPA_BANDED
    assert default_attention(torch.device("cuda"), torch.bfloat16, sliding=True) == "sdpa"
    text = " ".join(f"w{i}" for i in range(300))
    assert len(tok(text)["input_ids"]) > 2 * BAND_ROWS
    calls = _band_calls(monkeypatch)
    ours = HFBackend(banded, tok).generate([text], max_new_tokens=6, stop_at_newline=False)
    assert max(n for _, n in calls) < len(tok(text)["input_ids"])  # no block read every key
    ref = HFBackend(plain, tok).generate([text], max_new_tokens=6, stop_at_newline=False)
    assert ours[0].token_ids == ref[0].token_ids and len(ours[0].token_ids) == 6
    a, b = (HFBackend(m, tok).next_token_logprobs([text])[0] for m in (banded, plain))
    assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-4)


def test_bench_band_times_sdpa_against_each_block_size_and_compares_the_logits(tmp_path):
    """``ragfix bench band`` on a tiny sliding-window model: one SDPA row and one row per block
    size at each length, its logits within float32 rounding of SDPA's and the result file
    written; a model without sliding layers is refused in one line."""
    from typer.testing import CliRunner

    from ragfix.cli.app import app

    folder = tiny_folder(tmp_path / "mistral", arch="mistral")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"sliding_window": 64}))
    out = tmp_path / "band.json"
    args = ["bench", "band", "--model", str(folder), "--lengths", "200,400", "--rows", "64,128"]
    result = CliRunner().invoke(app, [*args, "--repeats", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["tokens"], r["attention"]) for r in runs] == [
        (n, a) for n in (200, 400) for a in ("sdpa", "banded, 64 rows", "banded, 128 rows")
    ]
    banded = [r for r in runs if r["attention"] != "sdpa"]
    assert all(r["same_argmax"] and r["max_logit_diff"] < 1e-4 for r in banded)
    assert all(r["seconds"] > 0 for r in runs)
    llama = tiny_folder(tmp_path / "llama")
    result = CliRunner().invoke(app, ["bench", "band", "--model", str(llama), "--lengths", "100"])
    assert result.exit_code == 2 and "has no sliding-window layer" in result.output
