"""The commands ``demo``, ``models`` and ``eval`` (its errors), and the Python API behind
``eval`` (:func:`ragfix.eval.run_sweep`), with the real embedded model on bundled data."""

from __future__ import annotations

import json

import pytest
from conftest import BUNDLED
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.eval import run_sweep

NQ = BUNDLED / "nq_10docs_sample.jsonl.gz"
runner = CliRunner()


def _records(out):
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]


def test_demo_on_one_sample_writes_a_real_summary(tmp_path):
    out = tmp_path / "demo"
    res = runner.invoke(app, ["demo", "--limit", "1", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    recs = _records(out)
    assert summary["cells"] == len(recs) == 8 and summary["task"] == "kv"
    curve = summary["curves"]["vanilla"]
    assert [p["position"] for p in curve["positions"]] == list(range(8))
    assert [p["n"] for p in curve["positions"]] == [1] * 8
    assert curve["mean"] == pytest.approx(sum(r["correct"] for r in recs) / 8)
    assert summary["prefill_tokens"] > 0 and all(r["answer"] for r in recs)
    assert "gap" in res.output and str(out / "summary.json") in " ".join(res.output.split())


def test_models_lists_the_embedded_model():
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines() if "smollm2" in line]
    assert rows and "yes" in rows[0]  # installed


def test_eval_on_a_missing_file_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "nope.jsonl"
    res = runner.invoke(app, ["eval", str(missing), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [f"error: {missing}: file not found"]
    assert not (tmp_path / "o").exists()


def test_a_failed_first_run_does_not_block_the_corrected_rerun(tmp_path):
    out = tmp_path / "run"
    args = ["eval", str(NQ), "--num-docs", "3", "--positions", "first", "--limit", "1"]
    args += ["--device", "cpu", "--out", str(out)]
    res = runner.invoke(app, [*args, "--adapter", str(tmp_path / "no-adapter")])
    assert res.exit_code == 2 and "not an adapter folder" in res.output
    assert not (out / "config.json").exists()
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    assert config["backend_options"] == {} and len(_records(out)) == 1


def test_run_sweep_answers_are_the_same_with_and_without_prefix_reuse(tmp_path):
    runs, seen = {}, {}
    for reuse in (True, False):
        out = tmp_path / f"reuse-{reuse}"
        seen[reuse] = []
        summary = run_sweep(
            NQ,
            out,
            num_docs=3,
            positions="all",
            limit=1,
            prefix_reuse=reuse,
            device="cpu",
            on_record=seen[reuse].append,
        )
        assert summary == json.loads((out / "summary.json").read_text())
        runs[reuse] = {r["cell_id"]: r for r in _records(out)}
    on, off = runs[True], runs[False]
    assert len(on) == 3 and set(on) == set(off)  # same cells, same ids
    assert {k: r["answer"] for k, r in on.items()} == {k: r["answer"] for k, r in off.items()}
    assert [r.position for r in seen[True]] == [2, 1, 0]  # last position first, then reuse
    assert sum(r["prefill_tokens"] for r in on.values()) < sum(
        r["prefill_tokens"] for r in off.values()
    )
    # a rerun computes nothing
    again = []
    run_sweep(
        NQ, tmp_path / "reuse-True", num_docs=3, limit=1, device="cpu", on_record=again.append
    )
    assert again == []
