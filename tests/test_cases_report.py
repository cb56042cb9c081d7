"""Issue 13's failing case of ``ragfix report`` (tests/cases/32_report_mismatched_runs.json),
run as the case gives it: the real model on the bundled KV sample."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from ragfix.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def kv_runs(tmp_path_factory):
    """``ragfix eval kv-sample --num-docs 4|8 --positions 0,3 --limit 1`` (two cells each)."""
    tmp = tmp_path_factory.mktemp("case32")
    for n in (4, 8):
        res = runner.invoke(
            app,
            ["eval", "kv-sample", "--num-docs", str(n), "--positions", "0,3", "--limit", "1",
             "--device", "cpu", "--out", str(tmp / f"run-{n}docs")],
        )  # fmt: skip
        assert res.exit_code == 0, res.output
    return tmp


def test_case32_runs_with_4_and_8_documents_are_not_paired(kv_runs):
    """Case 32: position 3 is the last of 4 documents but the middle of 8; the cells have the
    same keys, yet no paired table, mean difference or McNemar p may be printed: the curves are
    drawn side by side with one note naming num_docs 4 vs 8."""
    a, b = kv_runs / "run-4docs", kv_runs / "run-8docs"
    png, js = kv_runs / "cmp.png", kv_runs / "cmp.json"
    res = runner.invoke(app, ["report", str(a), str(b), "--out", str(png), "--json", str(js)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "run-8docs not paired with run-4docs: num_docs 4 vs 8" in text
    assert "McNemar" not in text and "mean difference" not in text and "same samples" not in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    cmp = json.loads(js.read_text())
    assert cmp["paired"] == [] and cmp["groups"] == [["run-4docs"], ["run-8docs"]]
    assert [r["config"]["num_docs"] for r in cmp["runs"]] == [4, 8]


def test_case32_runs_that_differ_only_in_backend_are_still_paired(kv_runs, tmp_path):
    """Case 32, the other half: the same cells under another model or backend are paired."""
    a = kv_runs / "run-4docs"
    other = tmp_path / "other-backend"
    shutil.copytree(a, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "backend": "x", "model": "y"}))
    res = runner.invoke(app, ["report", str(a), str(other), "--out", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "other-backend:vanilla vs run-4docs:vanilla: 2 cells (1 samples)" in text
    assert "McNemar p = 1 (not significant at 0.05)" in text and "not paired" not in text
