"""``ragfix eval-ppl`` on a tiny input: the real SmolLM2 at a lowered trained window of 64 tokens,
vanilla and GALI at 1x and 2x the window."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.eval.ppl import read_texts

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


def test_eval_ppl_vanilla_and_gali(essay, tmp_path, smol):
    out = tmp_path / "ppl"
    args = ["eval-ppl", str(essay), "--out", str(out), "--train-window", "64", "--ratios", "1,2"]
    args += ["--methods", "vanilla,gali", "--samples", "1", "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "ppl.json").read_text())
    assert [(r["method"], r["length"]) for r in rows] == [
        ("vanilla", 64),
        ("vanilla", 128),
        ("gali", 64),
        ("gali", 128),
    ]
    assert all(r["train_window"] == 64 and r["samples"] == 1 for r in rows)
    assert all(math.isfinite(r["ppl"]) and 1 < r["ppl"] < 1000 for r in rows)
    assert all(math.isfinite(r["ppl_tail"]) for r in rows)
    ppl = {(r["method"], r["length"]): r["ppl"] for r in rows}
    # within the window GALI is the unmodified model
    assert ppl["gali", 64] == pytest.approx(ppl["vanilla", 64], rel=1e-5)
    # past it, GALI's interpolated positions change the numbers
    assert ppl["gali", 128] != pytest.approx(ppl["vanilla", 128], rel=1e-3)
    # the vanilla row is the perplexity of the essay's first 64 tokens
    ids = smol.tokenize(read_texts(essay))[:64]
    expected = math.exp(-smol.token_logprobs(ids).double().mean().item())
    assert ppl["vanilla", 64] == pytest.approx(expected, rel=1e-5)
    assert (out / "ppl.md").read_text().startswith("Perplexity (all tokens)")
    assert (out / "ppl.png").stat().st_size > 0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--methods", "vanilla,bogus"], "unknown method(s) ['bogus']"),
        (["--ratios", "1,x"], "--ratios '1,x': expected numbers"),
        (["--train-window", "4096", "--methods", "vanilla", "--ratios", "2"], "need 2 x 8192"),
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
