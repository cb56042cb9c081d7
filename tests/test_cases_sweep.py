"""The failing cases of issue 13 that belong to the sweep (``tests/cases``): 12 (prompts over
the context window) and 09 (degenerate gold answers), each asserted on its right value, through
the raw sweep (``ragfix eval``) and the pipeline sweep."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import BUNDLED, case_file, data_file, run_records, tiny_folder
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.eval import run_sweep
from ragfix.metrics import best_subspan_em, degenerate_gold, normalize_answer

NQ = BUNDLED / "nq_10docs_sample.jsonl.gz"
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_2048(tmp_path_factory):
    """The case's model window: 2048 tokens."""
    spec = json.loads(case_file("12_context_overflow.json").read_text())
    return tiny_folder(tmp_path_factory.mktemp("tiny2048"), window=spec["model_context_window"])


def _case12_data(path):
    """Case 12's input: the first question of the 20-document BM25-pool file made a 30-document
    record with distractors of other records appended, and a second 30-document record of short
    passages that fits the window (so the run has a question at every position to score)."""
    with gzip.open(data_file("derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz"), "rt") as f:
        recs = [json.loads(next(f)) for _ in range(4)]
    first = recs[0]
    gold = normalize_answer(first["answers"][0])
    extra = [
        c
        for r in recs[1:]
        for c in r["ctxs"]
        if not c["isgold"] and gold not in normalize_answer(c["text"])
    ]
    first = {**first, "ctxs": first["ctxs"] + extra[:15]}
    short = {
        "question": "what colour is the sky on planet zog",
        "answers": ["green"],
        "ctxs": [{"title": "Zog", "text": "The sky of Zog is green.", "isgold": True}]
        + [{"title": f"Note {i}", "text": f"Note number {i}.", "isgold": False} for i in range(29)],
    }
    path.write_text(json.dumps(first) + "\n" + json.dumps(short) + "\n")
    return path


def test_case12_overflow_is_flagged_before_the_model_runs_and_counted(tiny_2048, tmp_path):
    """Case 12: a 30-document prompt longer than the 2048-token window is never run (nor cut):
    its cells are flagged ``overflow``, the question is left out of the accuracy at every
    position, and the overflow cells are counted per position in summary.json and the table."""
    data = _case12_data(tmp_path / "case12.jsonl")
    out = tmp_path / "run"
    args = ["eval", str(data), "--model", str(tiny_2048), "--num-docs", "30"]
    args += ["--positions", "0,14,29", "--device", "cpu", "--out", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    every = run_records(out)
    recs = [r for r in every if r["reference"] is None]
    over = [r for r in recs if "overflow" in r["flags"]]
    fit = [r for r in recs if "overflow" not in r["flags"]]
    assert sorted(r["position"] for r in over) == [0, 14, 29]
    assert len({r["sample_id"] for r in over}) == 1
    for r in over:  # nothing ran: no answer, no tokens read, the full length recorded
        assert r["answer"] == "" and r["new_tokens"] == 0 and r["prefill_tokens"] == 0
        assert r["prompt_tokens"] + 32 > 2048 and r["prompt_position"] == -1
        assert r["correct"] is False
    assert sorted(r["position"] for r in fit) == [0, 14, 29]
    assert all(r["prefill_tokens"] > 0 and r["prompt_tokens"] + 32 <= 2048 for r in fit)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["flags"]["overflow"] == {"0": 1, "14": 1, "29": 1}
    # its reference points fit and ran, and the sample is left out of them too
    refs = [r for r in every if r["reference"] and r["sample_id"] in {o["sample_id"] for o in over}]
    assert len(refs) == 2 and all(r["new_tokens"] > 0 for r in refs)
    n = summary["curves"]["vanilla"]["positions"][0]["n"]
    assert summary["references"]["vanilla"]["oracle"]["n"] == n
    assert summary["cells"] == 6 and summary["scored_cells"] == 3
    assert summary["excluded_samples"] == 1
    curve = summary["curves"]["vanilla"]
    assert [p["n"] for p in curve["positions"]] == [1, 1, 1]  # same question at every position
    assert curve["mean"] == pytest.approx(sum(r["correct"] for r in fit) / 3)
    text = " ".join(res.output.split())
    assert "flagged cells per prompt position" in text and "overflow" in text
    assert "1 sample(s) have a cell that is not scored" in text and "3 of 6 cells scored" in text
    assert "overflow: 3 cell(s), the prompt does not fit the context window" in text


def test_case12_a_backend_that_cuts_by_design_runs_and_flags_the_cell(tmp_path):
    """Case 12, the ``truncated`` baseline: cutting is the method, so the cell runs on the cut
    prompt (``prefill_tokens`` = window - answer budget) and is flagged ``cut_to_window``."""
    model = tiny_folder(tmp_path / "tiny", window=2048)
    out = tmp_path / "run"
    recs = []
    summary = run_sweep(
        NQ,
        out,
        model=str(model),
        backend="truncated",
        backend_options={"train_window": 256},
        num_docs=3,
        positions="first",
        limit=1,
        device="cpu",
        on_record=recs.append,
        references=False,
    )
    [r] = recs
    assert r.flags == ["cut_to_window"] and r.prompt_tokens > 256 and r.prefill_tokens == 224
    assert summary["flags"] == {"cut_to_window": {"0": 1}} and summary["scored_cells"] == 1


def test_case12_pipeline_sweep_flags_overflow_without_running(tmp_path):
    """Case 12 in the pipeline sweep: with a 600-token window the question's ten candidate
    chunks do not fit; every cell is flagged ``overflow`` before the postprocessor drops a chunk
    or the model runs, and counted per retrieval rank."""
    from ragfix.connectors.corpus import DEMO_CORPUS, DEMO_QUESTIONS
    from ragfix.eval.pipeline import run_pipeline_sweep

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(DEMO_CORPUS.read_text().splitlines(keepends=True)[:12]))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(DEMO_QUESTIONS.read_text().splitlines(keepends=True)[0])
    out = tmp_path / "run"
    summary = run_pipeline_sweep(
        corpus=corpus,
        questions=questions,
        out=out,
        strategies=["none", "reverse"],
        top_k=10,
        positions="0,9",
        model=str(tiny_folder(tmp_path / "tiny", window=600)),
        retriever="bm25",
        device="cpu",
    )
    recs = run_records(out)
    assert len(recs) == 4 and all(r["flags"] == ["overflow"] for r in recs)
    assert all(r["new_tokens"] == 0 and r["prompt_tokens"] + 32 > 600 for r in recs)
    assert summary["flags"] == {"overflow": {"0": 2, "9": 2}}
    assert summary["curves"] == {} and summary["excluded_samples"] == 1


def test_case09_degenerate_golds_are_flagged_with_their_reason_and_scored_strictly():
    """Case 09: each gold that normalises to nothing, to one character or to a stopword gets the
    case's flag; the strict score is the case's (an empty gold never matches)."""
    lines = case_file("09_subspan_em_degenerate_gold.jsonl").read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        case = json.loads(line)
        assert degenerate_gold(case["answers"]) == [case["expected_flag"]]
        assert (
            float(best_subspan_em(case["model_answer"], case["answers"]))
            == (case["expected_strict"])
        )


def test_case09_sweep_counts_degenerate_gold_cells_in_summary_and_table(tmp_path):
    """Case 09 end to end: the four records as a one-passage sweep with the real model; every
    cell is flagged ``degenerate_gold`` with its reason, scored, and counted in summary.json and
    the printed table."""
    lines = case_file("09_subspan_em_degenerate_gold.jsonl").read_text().splitlines()
    src = [json.loads(x) for x in lines]
    data = tmp_path / "case09.jsonl"
    data.write_text(case_file("09_subspan_em_degenerate_gold.jsonl").read_text())
    out = tmp_path / "run"
    res = runner.invoke(
        app,
        ["eval", str(data), "--num-docs", "1", "--no-references", "--device", "cpu"]
        + ["--out", str(out)],
    )
    assert res.exit_code == 0, res.output
    recs = run_records(out)
    assert len(recs) == 4 and all(r["flags"] == ["degenerate_gold"] for r in recs)
    reasons = sorted(r["extra"]["degenerate_gold"][0] for r in recs)
    assert reasons == sorted(c["expected_flag"] for c in src)
    for r, c in zip(recs, src, strict=True):  # scored by the same strict metric
        assert r["correct"] == best_subspan_em(r["answer"], c["answers"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["flags"] == {"degenerate_gold": {"0": 4}}
    assert summary["scored_cells"] == 4 and summary["curves"]["vanilla"]["positions"][0]["n"] == 4
    text = " ".join(res.output.split())
    assert "flagged cells per prompt position" in text and "degenerate_gold" in text


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_answer_budget_that_fills_the_window_is_one_line_naming_both(tmp_path, workers):
    """The kind of case 07 in the sweep: a model whose whole window is the answer budget can fit
    no prompt; the run stops before any cell with both numbers named, and leaves no config. In
    worker processes the error crosses to the parent unchanged."""
    model = tiny_folder(tmp_path / "tiny", window=32)
    out = tmp_path / "run"
    args = ["eval", str(NQ), "--model", str(model), "--num-docs", "2", "--limit", "2"]
    res = runner.invoke(app, [*args, "--device", "cpu", "--workers", workers, "--out", str(out)])
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert "answer budget of 32 tokens leaves no room for a prompt in the 32-token window" in line
    assert not (out / "config.json").exists()
