"""``ragfix bench serve``: the load test run for real, small (``ragfix serve`` over a tiny seeded
model folder with the SmolLM2 tokenizer, 2 clients, 2 requests, in float32 and bf16), its tables
read cell by cell and its result file rendered."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_folder
from typer.testing import CliRunner

from ragfix.bench.serve import SHORT_PROMPT_TOKENS, bad_requests, dtype_table, short_prompts
from ragfix.cli.app import app

runner = CliRunner()


def test_bench_serve_reports_identical_answers_and_every_bad_request_refused(tmp_path):
    """Both dtypes' servers: the float32 one's tables checked cell by cell, the comparison
    table's ratios and identical answers recomputed from the measurements."""
    from ragfix.eval.render import render_files

    folder = str(tiny_folder(tmp_path / "tiny"))
    out = tmp_path / "serve-load.json"
    args = [
        "bench", "serve", "--model", folder, "--clients", "2", "--requests", "2",
        "--long-requests", "2", "--burst-clients", "2", "--burst-rounds", "1",
        "--max-seconds", "120",
    ]  # fmt: skip
    twice = runner.invoke(app, [*args, "--dtype", "float32,auto"])
    assert twice.exit_code == 2 and "a dtype is named twice" in twice.output
    res = runner.invoke(app, [*args, "--dtype", "float32,bfloat16", "--json", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    both, short, long, bf16_short, bf16_long = result, *result["more_tables"]
    assert "float32 ·" in short["title"] and "bfloat16 ·" in bf16_short["title"]
    assert "--dtype bfloat16 (1 math thread)" in " ".join(bf16_short["lines"])
    assert [(r[0], r[1]) for r in both["rows"]] == [
        ("short", "1"), ("short", "2"), ("long", "1"), ("long", "2"),
    ]  # fmt: skip
    by = result["measurements"]
    assert [by[n]["served_dtype"] for n in ("float32", "bfloat16")] == [
        "torch.float32",
        "torch.bfloat16",
    ]  # what each server's /v1/models said it runs
    for row, kind, i in zip(
        both["rows"], ["short", "short", "long", "long"], [0, 1, 0, 1], strict=True
    ):
        fp32, bf16 = by["float32"][kind][i], by["bfloat16"][kind][i]
        assert row[2:] == [
            f"{fp32['requests_per_s']:.3f}",
            f"{bf16['requests_per_s']:.3f}",
            f"{bf16['requests_per_s'] / fp32['requests_per_s']:.2f}",
        ]
    for kind in ("short", "long"):
        pairs = list(
            zip(by["float32"][f"{kind}_answers"], by["bfloat16"][f"{kind}_answers"], strict=True)
        )
        assert len(pairs) == 2 and all(a and b for a, b in pairs)
        same = sum(a == b for a, b in pairs)
        assert f"bfloat16, {kind} prompts: {same}/2 sequential answers identical" in " ".join(
            both["lines"]
        )
    n_bad = len(bad_requests(folder, 2048))
    # clients, answered, requests/s, ratio, p50, p95, same answers, bad refused
    assert [r[0] for r in short["rows"]] == ["1", "2", "2 + burst"]
    assert [r[1] for r in short["rows"]] == ["2/2"] * 3
    assert [r[6] for r in short["rows"]] == ["2/2"] * 3
    assert [r[7] for r in short["rows"]] == ["-", "-", f"{n_bad}/{n_bad}"]
    assert short["rows"][0][3] == "1.00"
    assert [(r[0], r[1], r[3], r[6]) for r in long["rows"]] == [
        ("1", "2/2", "1.00", "2/2"), ("2", "2/2", long["rows"][1][3], "2/2"),
    ]  # fmt: skip
    m = by["float32"]
    assert all(k["refused"] == k["sent"] == 1 for k in m["burst"]["burst"])
    statuses = {k["kind"]: k["statuses"] for k in m["burst"]["burst"]}
    assert statuses["5 MB body"] == ["413"] and statuses["unknown model"] == ["404"]
    assert statuses["prompt over the window (tokenized)"] == ["400"]
    assert m["burst"]["answers_after"] and m["burst"]["failed"] == 0
    assert max(m["short_prompt_tokens"]) <= SHORT_PROMPT_TOKENS
    assert min(m["long_prompt_tokens"]) >= 380
    assert "After it the server answered (/health, and the first prompt's sequential answer): " \
        "yes." in " ".join(short["lines"])  # fmt: skip
    # every table renders from the one result file
    doc = tmp_path / "d.md"
    doc.write_text(f"<!-- results:benchmark {out.name} -->\n<!-- /results -->\n")
    render_files([doc])
    text = doc.read_text()
    assert all(t["title"] in text for t in (both, short, long, bf16_short, bf16_long))


def test_short_prompts_fit_their_budget_in_the_chat_template(smol):
    """Every short prompt is at most 64 tokens as the server counts it (chat template)."""
    from ragfix.prompts import TaskPrompt

    for body in short_prompts(32):
        prompt = TaskPrompt(user=body["messages"][0]["content"])
        assert len(smol.encode(prompt)) <= SHORT_PROMPT_TOKENS


def _levels(rps: dict[int, float]) -> list[dict]:
    return [{"clients": c, "requests_per_s": r} for c, r in rps.items()]


def _details(first: str, second: str, short: tuple[dict, dict], answers=("a", "b")) -> dict:
    def served(levels: dict, ans: list) -> dict:
        return {
            "short": _levels(levels),
            "long": _levels({1: 0.5}),
            "short_answers": list(ans),
            "long_answers": ["x"],
        }

    return {
        "model": "m",
        "dtypes": [first, second],
        "machine": "here",
        "server": "ragfix serve",
        "measurements": {
            first: served(short[0], ["a", "b"]),
            second: served(short[1], list(answers)),
        },
    }


def test_the_dtype_table_sets_each_level_against_the_first_dtype_and_says_the_target():
    """A hand-built result: ratios by client count, identical sequential answers, issue 57's
    line (met, not met, not measured at 0 requests/s, none for another order), and levels that
    differ between the dtypes refused."""
    from ragfix.errors import ConfigError

    met = dtype_table(_details("float32", "bfloat16", ({1: 0.5, 8: 1.0}, {1: 0.6, 8: 2.5})))
    assert met.rows == [
        ["short", "1", "0.500", "0.600", "1.20"],
        ["short", "8", "1.000", "2.500", "2.50"],
        ["long", "1", "0.500", "0.500", "1.00"],
    ]
    lines = " ".join(met.lines)
    assert "bfloat16, short prompts: 2/2 sequential answers identical to float32's." in lines
    assert "8 clients, short prompts: bfloat16 2.50x float32's requests/s, met" in lines
    short = ({1: 0.5, 8: 1.0}, {1: 0.5, 8: 1.5})
    low = dtype_table(_details("float32", "bfloat16", short, answers=("a", "c")))
    assert "1/2 sequential answers identical" in " ".join(low.lines)
    assert "bfloat16 1.50x float32's requests/s, not met" in " ".join(low.lines)
    zero = dtype_table(_details("float32", "bfloat16", ({1: 0.5, 8: 0.0}, {1: 0.5, 8: 1.0})))
    assert zero.rows[1][-1] == "-"
    assert "not measured: no float32 requests/s at 8 clients" in " ".join(zero.lines)
    other = dtype_table(_details("bfloat16", "float32", ({1: 0.5, 8: 1.0}, {1: 0.5, 8: 0.5})))
    assert other.rows[1][-1] == "0.50" and "issue 57" not in " ".join(other.lines)
    with pytest.raises(ConfigError, match="levels are not"):
        dtype_table(_details("float32", "bfloat16", ({1: 0.5, 8: 1.0}, {1: 0.5, 4: 1.0})))
