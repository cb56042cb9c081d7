"""``ragfix eval-ppl``: the real SmolLM2 at lowered trained windows on short texts (vanilla, GALI,
truncation, a GALI grid on a window range), the split by query position on tiny seeded models,
the intervals and the pairing, the ``ppl`` render kind, and one-line errors."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from conftest import data_file, fractional_queries, random_ids, tiny_model
from rich.console import Console
from typer.testing import CliRunner

from ragfix.backends.gali import GaliBackend
from ragfix.backends.hf import HFBackend
from ragfix.backends.truncated import TruncatedBackend
from ragfix.cli.app import app
from ragfix.errors import ConfigError, DataError
from ragfix.eval.ppl import (
    length_stats,
    method_variants,
    paired_with,
    parse_windows,
    read_texts,
    score_window,
    window_stats,
)
from ragfix.eval.ppl_tables import ppl_tables
from ragfix.eval.render import render_files
from ragfix.eval.results import load_result
from ragfix.tables import print_tables

#: one short essay (written for this test), well over the 2 x 64 tokens the run reads
ESSAY = (
    "The river town woke slowly in winter. Before dawn the baker lit his ovens, and the smell of "
    "bread drifted down the empty streets toward the water. Fishermen checked their nets by "
    "lantern light, talking quietly about the ice that had begun to form along the banks. By "
    "seven the school bell rang, and children ran across the old stone bridge, their breath "
    "hanging in the cold air. The mayor, who had lived there for sixty years, liked to say that "
    "nothing ever changed in the town, but that was not true. The mill had closed a decade ago, "
    "the railway station now sold coffee instead of tickets, and the young people left for the "
    "city as soon as they finished school. Still, every spring some of them came back for the "
    "festival, when boats decorated with flowers drifted past the houses and the whole town ate "
    "together at long tables by the river. On those evenings the mayor was almost right: the "
    "music, the food and the stories were the same as they had been when he was a boy. "
)


@pytest.fixture(scope="module")
def essay(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "essay.jsonl"
    path.write_text(json.dumps({"text": ESSAY}) + "\n")
    return path


def test_eval_ppl_vanilla_gali_truncated(essay, tmp_path, smol):
    out = tmp_path / "ppl"
    args = ["eval-ppl", str(essay), "--out", str(out), "--train-window", "64", "--ratios", "1,2"]
    args += ["--methods", "vanilla,gali,truncated", "--samples", "1", "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "ppl.json").read_text())
    assert result["kind"] == "ragfix-ppl" and result["windows"] == [0, 1]
    assert result["baseline"] == "vanilla" and result["window_tokens"] == 128
    rows = result["rows"]
    assert [(r["method"], r["length"]) for r in rows] == [
        ("vanilla", 64),
        ("vanilla", 128),
        ("gali", 64),
        ("gali", 128),
        ("truncated", 64),
        ("truncated", 128),
    ]
    assert all(r["train_window"] == 64 and r["windows"] == [0, 1] for r in rows)
    assert all(math.isfinite(r["ppl"]) and 1 < r["ppl"] < 1000 for r in rows)
    assert all(math.isfinite(r["ppl_tail"]) and r["ppl_ci"] is None for r in rows)  # 1 window
    ppl = {(r["method"], r["length"]): r["ppl"] for r in rows}
    # within the window GALI and truncation are the unmodified model
    assert ppl["gali", 64] == pytest.approx(ppl["vanilla", 64], rel=1e-5)
    assert ppl["truncated", 64] == pytest.approx(ppl["vanilla", 64], rel=1e-5)
    # past it, GALI's interpolated positions and truncation's shorter contexts change the numbers
    assert ppl["gali", 128] != pytest.approx(ppl["vanilla", 128], rel=1e-3)
    assert ppl["truncated", 128] != pytest.approx(ppl["vanilla", 128], rel=1e-3)
    # the vanilla rows are the perplexities of the essay's first 64 and 128 tokens
    ids = smol.tokenize(read_texts(essay))[:128]
    for n in (64, 128):
        expected = math.exp(-smol.token_logprobs(ids[:n]).double().mean().item())
        assert ppl["vanilla", n] == pytest.approx(expected, rel=1e-5)
    # GALI's defaults at L = 64: chunks of 8 (L / 8) and a local window of 8, so no query is
    # at an interpolated position (the paper's 23 and 1 would put some there)
    gali = {r["length"]: r for r in rows if r["method"] == "gali"}
    assert gali[128]["options"]["chunk_size"] == 8 and gali[128]["options"]["local_window"] == 8
    assert gali[128]["tokens_interp"] == fractional_queries(128, 64, 8, 8) == 0
    assert fractional_queries(128, 64, 1, 23) > 0
    assert gali[64]["tokens_interp"] == 0 and gali[64]["ppl_interp"] is None
    for r in rows:
        assert r["tokens_interp"] + r["tokens_whole"] == r["tokens"] == r["length"] - 1
        if r["method"] != "gali":
            assert r["tokens_interp"] == 0 and r["ppl_whole"] == pytest.approx(r["ppl"])
    # vs the baseline: the ratio of perplexities (equal token counts per window)
    t128 = next(r for r in rows if r["method"] == "truncated" and r["length"] == 128)
    assert t128["vs_baseline"]["ppl_ratio"] == pytest.approx(
        ppl["truncated", 128] / ppl["vanilla", 128]
    )
    md = (out / "ppl.md").read_text()
    assert md.startswith("**Perplexity by length**") and "| truncated | 128 | 2 |" in md
    assert "Perplexity by query position ID" in res.output  # the printed tables
    assert (out / "ppl.png").stat().st_size > 0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--methods", "vanilla,bogus"], "unknown method(s) ['bogus']"),
        (["--methods", "vanilla,vanilla"], "method(s) ['vanilla'] given more than once"),
        (["--ratios", "1,x"], "--ratios '1,x': expected numbers"),
        (["--train-window", "4096", "--methods", "vanilla", "--ratios", "2"], "need 2 x 8192"),
        (["--samples", "2", "--windows", "0:2"], "give --samples N or --windows START:STOP"),
        (["--windows", "3:1"], "--windows '3:1': expected START:STOP with 0 <= START < STOP"),
        (["--methods", "vanilla", "--gali-grid", "chunk_size=8"], "needs gali among the methods"),
        (["--methods", "gali", "--gali-grid", "chunk_size="], "'chunk_size=': expected option="),
        (
            ["--methods", "gali", "--gali-grid", "chunk_size=8", "--backend-opt", "chunk_size=4"],
            "['chunk_size'] set both as an option and a grid",
        ),
        (["--methods", "gali", "--gali-grid", "chunk_sise=8"], "chunk_sise: Extra inputs"),
        (["--methods", "gali", "--gali-grid", "chunk_size=0"], "chunk_size: Input should be"),
        (["--methods", "vanilla,gali", "--baseline", "yarn"], "baseline 'yarn' is not among"),
    ],
)
def test_eval_ppl_user_errors_are_one_line(essay, tmp_path, extra, message):
    res = CliRunner().invoke(app, ["eval-ppl", str(essay), "--out", str(tmp_path), *extra])
    assert res.exit_code == 2, res.output
    last = res.output.strip().splitlines()[-1]  # after any weight-loading progress bar
    assert last.startswith("error: ") and message in last


def test_eval_ppl_missing_file(tmp_path):
    res = CliRunner().invoke(app, ["eval-ppl", str(tmp_path / "none.jsonl"), "--out", "x"])
    assert res.exit_code == 2
    assert "none.jsonl: file not found" in res.output


def test_eval_ppl_gali_grid_on_a_window_range(tmp_path, smol):
    data = data_file("needle_paul_graham_essays.jsonl.gz")
    out = tmp_path / "grid"
    args = ["eval-ppl", str(data), "--out", str(out), "--train-window", "32", "--ratios", "4"]
    args += ["--windows", "1:3", "--methods", "vanilla,gali", "--backend-opt", "noise=false"]
    args += ["--gali-grid", "chunk_size=8,24", "--gali-grid", "local_window=4,8"]
    res = CliRunner().invoke(app, [*args, "--device", "cpu"])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "ppl.json").read_text())
    rows = result["rows"]
    grid = [(8, 4), (8, 8), (24, 4), (24, 8)]
    assert [r["method"] for r in rows] == ["vanilla"] + [
        f"gali[chunk_size={s},local_window={w}]" for s, w in grid
    ]
    for r, (s, w) in zip(rows[1:], grid, strict=True):
        assert r["options"]["chunk_size"] == s and r["options"]["local_window"] == w
        assert r["options"]["noise"] is False and r["options"]["target_window"] == 128
        # two windows of 128 tokens, each with the split implied by GALI's positions
        assert r["tokens_interp"] == 2 * fractional_queries(128, 32, w, s)
        assert r["tokens"] == 2 * 127 and r["windows"] == [1, 3]
        assert r["vs_baseline"]["baseline"] == "vanilla"
        iv = r["vs_baseline"]["ppl_ratio_ci"]
        assert iv["low"] <= r["vs_baseline"]["ppl_ratio"] <= iv["high"]
    assert [r["tokens_interp"] for r in rows] == [0, 10, 0, 88, 88]
    ppl = [r["ppl"] for r in rows]
    # chunks of 24 give every chunk the same positions with W = 4 and W = 8 (g and i coincide at
    # T = 56, 80, 104, 128): the same run; every other variant is a run of its own
    assert ppl[3] == ppl[4] and len({round(p, 6) for p in ppl}) == 4
    # window k reads the tokens k x 128 .. k x 128 + 127: windows 1 and 2 here, never window 0
    ids = smol.tokenize(read_texts(data)[: 3 * 128 * 12])
    van = rows[0]
    for i, k in enumerate((1, 2)):
        nll = -smol.token_logprobs(ids[k * 128 : (k + 1) * 128]).double().mean().item()
        assert van["window_nll"][i] == pytest.approx(nll, rel=1e-5)
    assert van["ppl"] == pytest.approx(math.exp(sum(van["window_nll"]) / 2))
    assert van["ppl_ci"]["low"] < van["ppl"] < van["ppl_ci"]["high"]
    assert van["vs_baseline"] is None and result["windows"] == [1, 3]


def test_parse_windows():
    assert parse_windows("0:3") == range(0, 3)
    assert parse_windows("3:13") == range(3, 13)
    for bad in ("3:1", "2:2", "-1:2", "a:b", "3", ":4"):
        with pytest.raises(ConfigError, match="expected START:STOP"):
            parse_windows(bad)


def test_method_variants_grid_order_and_options():
    vs = method_variants(
        ["yarn", "gali", "truncated"],
        train_window=512,
        max_ratio=4,
        gali_options={"noise": False},
        gali_grid={"chunk_size": [32, 64, 128, 187], "local_window": [8, 16, 32]},
    )
    assert [v.label for v in vs][:3] == [
        "yarn",
        "gali[chunk_size=32,local_window=8]",
        "gali[chunk_size=32,local_window=16]",
    ]
    assert len(vs) == 1 + 12 + 1 and vs[-1].label == "truncated"
    assert vs[0].options == {"rope_type": "yarn", "train_window": 512, "factor": 4}
    assert vs[-2].options == {
        "train_window": 512,
        "target_window": 2048,
        "noise": False,
        "chunk_size": 187,
        "local_window": 32,
    }
    assert [v.label for v in method_variants(["gali"], train_window=64, max_ratio=2)] == ["gali"]


# ---------------------------------------------------------------- tiny seeded models
@pytest.mark.parametrize("n,big_l,w,s", [(57, 16, 3, 5), (64, 16, 1, 12), (33, 16, 2, 16)])
def test_query_kind_split_has_the_counts_of_gali_positions(smol, n, big_l, w, s):
    model = tiny_model("llama", seed=0)
    b = GaliBackend(model, smol.tokenizer, train_window=big_l, chunk_size=s, local_window=w)
    windows = [window_stats(*score_window(b, random_ids(n, seed))) for seed in (1, 2)]
    st = length_stats(windows)
    expected = fractional_queries(n, big_l, w, s)
    assert expected > 0
    assert st["tokens_interp"] == 2 * expected and st["tokens_whole"] == 2 * (n - 1 - expected)
    # the two kinds split the pooled NLL: N log ppl = N_i log ppl_i + N_w log ppl_w
    pooled = st["tokens_interp"] * math.log(st["ppl_interp"])
    pooled += st["tokens_whole"] * math.log(st["ppl_whole"])
    assert pooled == pytest.approx(st["tokens"] * math.log(st["ppl"]), rel=1e-9)
    assert st["ppl_interp"] != pytest.approx(st["ppl_whole"], rel=1e-3)


def test_whole_number_ppl_of_gali_within_the_window_is_vanilla(smol):
    model = tiny_model("qwen2", seed=2)
    gali = GaliBackend(model, smol.tokenizer, train_window=32, chunk_size=5, local_window=2)
    vanilla = HFBackend(model, smol.tokenizer)
    texts = [random_ids(32, seed) for seed in (1, 2, 3)]
    g = length_stats([window_stats(*score_window(gali, ids)) for ids in texts])
    v = length_stats([window_stats(*score_window(vanilla, ids)) for ids in texts])
    assert g["tokens_interp"] == 0 and g["ppl_interp"] is None and g["tokens_whole"] == 3 * 31
    assert g["ppl_whole"] == pytest.approx(v["ppl"], rel=1e-5)
    assert g["window_nll"] == pytest.approx(v["window_nll"], rel=1e-5)
    # and a method without query positions reads whole-number positions only, even past L
    truncated = TruncatedBackend(model, smol.tokenizer, train_window=8)
    t = length_stats([window_stats(*score_window(truncated, texts[0]))])
    assert t["tokens_interp"] == 0 and t["ppl_whole"] == pytest.approx(t["ppl"])


# ---------------------------------------------------------------- intervals and pairing
def _window(nll: float, n: int = 9) -> dict:
    return window_stats(torch.full((n,), -nll), torch.arange(n, dtype=torch.float64))


def _rows() -> list[dict]:
    """Two methods at one length over two windows: vanilla at perplexities 20 and 30, gali at
    twice that in every window (NLL + log 2)."""
    base = [math.log(20), math.log(30)]
    rows = []
    for method, shift in (("vanilla", 0.0), ("gali[chunk_size=64]", math.log(2))):
        st = length_stats([_window(x + shift) for x in base])
        rows.append({"method": method, "length": 10, "ratio": 1.0, "vs_baseline": None, **st})
    return rows


def test_intervals_over_windows_and_paired_ratio():
    rows = _rows()
    van, gali = rows
    assert van["ppl"] == pytest.approx(math.sqrt(20 * 30))  # exp of the mean NLL per window
    # percentile bootstrap of two windows: the extremes are both windows drawn alike
    assert van["ppl_ci"] == pytest.approx({"low": 20.0, "high": 30.0})
    paired_with(rows, "vanilla")
    vs = gali["vs_baseline"]
    assert vs["nll_diff"] == pytest.approx(math.log(2))
    # the same shift in every window: no spread in the paired difference
    assert vs["nll_diff_ci"] == pytest.approx({"low": math.log(2), "high": math.log(2)})
    assert vs["ppl_ratio"] == pytest.approx(2.0) and vs["ppl_ratio_ci"]["low"] == pytest.approx(2)
    assert van["vs_baseline"] is None
    with pytest.raises(ConfigError, match="baseline 'yarn' is not among the methods"):
        paired_with(rows, "yarn")
    single = length_stats([_window(1.0)])
    assert single["ppl_ci"] is None and single["ppl"] == pytest.approx(math.e)


def test_ppl_result_renders_as_its_tables_and_only_as_ppl(tmp_path):
    rows = _rows()
    paired_with(rows, "vanilla")
    result = {
        "kind": "ragfix-ppl",
        "model": "smollm2",
        "data": "essays.jsonl.gz",
        "train_window": 10,
        "windows": [3, 5],
        "window_tokens": 10,
        "baseline": "vanilla",
        "bootstrap": {"method": "percentile", "resamples": 2000, "seed": 0},
        "rows": rows,
    }
    (tmp_path / "ppl.json").write_text(json.dumps(result))
    doc = tmp_path / "d.md"
    doc.write_text("text\n<!-- results:ppl ppl.json -->\n<!-- /results -->\n")
    assert render_files([doc]) == [doc]
    md = doc.read_text()
    assert "| vanilla | 10 | 1 | 24.49 | [20.00, 30.00] | 24.49 | — | — |" in md
    gali = "gali[chunk_size=64]"
    assert f"| {gali} | 10 | 1 | 48.99 | [40.00, 60.00] | 48.99 | 2.000 | [2.000, 2.000] |" in md
    assert f"| {gali} | 10 | 0 | n/a | 18 | 48.99 |" in md  # no interpolated query here
    assert "2 text windows (3 to 4) of 10 tokens from essays.jsonl.gz" in md
    assert render_files([doc], check=True) == []
    # printed, the labels keep their brackets (not read as rich markup)
    console = Console(width=200, file=io.StringIO())
    print_tables(ppl_tables(load_result(tmp_path / "ppl.json")), console)
    assert f"│ {gali} │" in console.file.getvalue()
    doc.write_text("<!-- results:merit ppl.json -->\n<!-- /results -->\n")
    with pytest.raises(DataError, match="ppl table kind is for perplexity result files"):
        render_files([doc])
