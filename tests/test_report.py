"""Comparing runs (figures of merit, pairing rules, ``ragfix report``) and rendering the results
tables of Markdown files (``ragfix render``)."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import bootstrap
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.errors import ConfigError, DataError, RagfixError
from ragfix.eval.compare import compare_runs, comparison_tables, record_range
from ragfix.eval.merit import curve_merit, paired_merit, retrieval_weighted_merit
from ragfix.eval.render import render_files
from ragfix.eval.sweep_summary import write_report
from ragfix.metrics import wilson_interval

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

# Two systems on 10 samples x 3 positions; sample i is right at a position when i < the count:
#   position:   0   1   2
#   baseline:   8   2   5    mean .5,    worst .2 @ 1, best .8 @ 0, gap .6
#   other:      8   9   6    mean .7667, worst .6 @ 2, best .9 @ 1, gap .3
# Discordant cells: position 1: 7 right only in other (McNemar p = 2 / 2**7), position 2: 1.
BASE_COUNTS, OTHER_COUNTS = (8, 2, 5), (8, 9, 6)


def _cells(counts, samples=10):
    return {(f"s{i}", pos): i < k for pos, k in enumerate(counts) for i in range(samples)}


def _run(folder: Path, counts, backend="vanilla", answer=lambda sid, pos: "", **config) -> Path:
    """A finished run folder written directly: results.jsonl, config.json, summary.json; each
    cell's answer is ``answer(sample_id, position)``."""
    folder.mkdir(parents=True)
    cfg = {"data": "/x/kv.jsonl.gz", "task": "kv", "num_docs": 3, "model": "smollm2"}
    cfg.update(backend=backend, **config)
    (folder / "config.json").write_text(json.dumps(cfg))
    records = [
        {
            "cell_id": f"{backend}-{sid}-{pos}",
            "sample_id": sid,
            "position": pos,
            "backend": backend,
            "strategy": "none",
            "correct": ok,
            "answer": answer(sid, pos),
        }
        for (sid, pos), ok in _cells(counts).items()
    ]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(folder, records)
    return folder


def _edit_records(folder: Path, edit) -> list[dict]:
    """Rewrite a run folder's results.jsonl as ``edit(records)`` returns them."""
    path = folder / "results.jsonl"
    records = edit([json.loads(x) for x in path.read_text().splitlines()])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def test_figures_of_merit_of_one_curve():
    m = curve_merit(_cells(BASE_COUNTS))
    assert (m.samples, m.cells) == (10, 30)
    assert m.mean == pytest.approx(0.5) and m.gap == pytest.approx(0.6)
    assert (m.worst_position, m.worst, m.best_position, m.best) == (1, 0.2, 0, 0.8)
    assert (m.worst_ci.low, m.worst_ci.high) == pytest.approx(wilson_interval(2, 10))
    assert m.mean_ci.low < m.mean < m.mean_ci.high
    assert m.gap_ci.low < m.gap < m.gap_ci.high
    # every position is complete, so the mean over positions is the mean over samples of each
    # sample's mean: scipy's own percentile bootstrap of that gives nearly the same interval
    per_sample = [np.mean([i < k for k in BASE_COUNTS]) for i in range(10)]
    ref = bootstrap(
        (per_sample,), np.mean, method="percentile", n_resamples=2000, random_state=1
    ).confidence_interval
    assert m.mean_ci.low == pytest.approx(ref.low, abs=0.04)
    assert m.mean_ci.high == pytest.approx(ref.high, abs=0.04)
    # seeded: the same numbers twice, and the settings travel with them
    assert curve_merit(_cells(BASE_COUNTS)) == m
    assert (m.bootstrap.method, m.bootstrap.resamples, m.bootstrap.seed) == ("percentile", 2000, 0)


def test_bootstrap_resamples_samples_not_cells():
    # every sample has the same outcome pattern (right at 0, wrong at 1): resampling samples
    # never changes the curve, so the intervals have no width; a cell bootstrap would give some
    cells = {(f"s{i}", pos): pos == 0 for i in range(20) for pos in (0, 1)}
    m = curve_merit(cells)
    assert (m.mean_ci.low, m.mean_ci.high) == (0.5, 0.5)
    assert (m.gap_ci.low, m.gap_ci.high) == (1.0, 1.0)
    # one sample: no bootstrap interval at all
    one = curve_merit({("s0", 0): True, ("s0", 1): False})
    assert one.mean_ci is None and one.gap_ci is None


def test_paired_figures_of_merit_and_mcnemar():
    pm = paired_merit(_cells(BASE_COUNTS), _cells(OTHER_COUNTS))
    assert (pm.samples, pm.cells) == (10, 30)
    assert [p.diff for p in pm.positions] == pytest.approx([0.0, 0.7, 0.1])
    p1, p2 = pm.positions[1], pm.positions[2]
    assert (p1.only_other, p1.only_baseline, p1.p_value) == (7, 0, pytest.approx(2 / 2**7))
    assert p1.significant and not p2.significant and p2.p_value == 1.0
    assert pm.mean_diff == pytest.approx(0.8 / 3) and pm.gap_diff == pytest.approx(-0.3)
    assert (pm.only_other, pm.only_baseline) == (8, 0)
    assert pm.p_value == pytest.approx(2 / 2**8) and pm.significant
    assert pm.mean_diff_ci.low < pm.mean_diff < pm.mean_diff_ci.high
    assert pm.mean_diff_ci.low > 0  # the gain is on the same samples: the interval excludes 0
    assert pm.gap_diff_ci.low < pm.gap_diff < pm.gap_diff_ci.high
    with pytest.raises(RagfixError, match="share no"):
        paired_merit({("a", 0): True}, {("b", 0): True})


def test_report_prints_merit_and_paired_tables_and_writes_json(tmp_path):
    base = _run(tmp_path / "base", BASE_COUNTS)
    other = _run(tmp_path / "lora", OTHER_COUNTS, backend="pos2distill", model="smollm2-r1")
    png, js = tmp_path / "cmp.png", tmp_path / "cmp.json"
    res = runner.invoke(
        app, ["report", str(base), str(other), "--out", str(png), "--json", str(js)]
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "figures of merit" in text and "base:vanilla" in text
    assert "McNemar p = 0.00781 (significant at 0.05)" in text
    assert "0.0156" in text and "mean difference +0.267" in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    cmp = json.loads(js.read_text())
    assert [r["config"]["backend"] for r in cmp["runs"]] == ["vanilla", "pos2distill"]
    (pair,) = cmp["paired"]
    assert (pair["baseline"], pair["other"]) == ("base:vanilla", "lora:pos2distill")
    assert pair["p_value"] == pytest.approx(2 / 2**8) and cmp["notes"] == []
    assert cmp["runs"][0]["curves"]["vanilla"]["gap"] == pytest.approx(0.6)
    # --markdown: the same tables as Markdown
    md = runner.invoke(app, ["report", str(base), str(other), "--out", str(png), "--markdown"])
    assert md.exit_code == 0, md.output
    assert "**figures of merit**" in md.output and "|---|---:|" in md.output
    assert "| 1 | 10 | 0.200 | 0.900 | +0.700 | 7 | 0 | 0.0156 | significant |" in md.output


def test_a_paired_comparison_counts_the_cells_answered_with_the_same_text(tmp_path):
    """Two runs that should agree (another dtype, batch or engine): the cells whose answers
    are the same text, surrounding whitespace aside, beside the labels' McNemar test."""
    base = _run(tmp_path / "fp32", BASE_COUNTS, answer=lambda sid, pos: f"answer {sid}")
    other = _run(
        tmp_path / "bf16",
        BASE_COUNTS,
        answer=lambda sid, pos: f" answer {sid}\n" if pos != 1 or sid < "s3" else "other",
        dtype="bfloat16",
    )
    (pair,) = compare_runs([base, other])["paired"]
    # position 1 differs for s3 .. s9 (7 cells); the other 23 agree (whitespace aside)
    assert (pair["same_answers"], pair["cells"]) == (23, 30)
    assert (pair["only_other"], pair["only_baseline"]) == (0, 0)
    res = runner.invoke(app, ["report", str(base), str(other), "--out", str(tmp_path / "p.png")])
    assert "the same answer text in 23 of 30 cells" in " ".join(res.output.split())


def test_retrieval_weighted_accuracy_and_its_table(tmp_path):
    # BASE_COUNTS per swept rank: acc(0) = .8, acc(1) = .2, acc(2) = .5. The retriever itself
    # ranked the gold chunk of s0-s5 at 0, of s6-s7 at 2, missed it for s8-s9:
    #   (6 * .8 + 2 * .5) / 8 = .725 over 8 of 10 questions
    cells = _cells(BASE_COUNTS)
    natural = {f"s{i}": 0 if i < 6 else 2 if i < 8 else None for i in range(10)}
    m = retrieval_weighted_merit(cells, natural)
    assert m.accuracy == pytest.approx(0.725) and (m.retrieved, m.questions) == (8, 10)
    assert m.ranks == {0: 6, 2: 2}
    assert m.ci.low <= m.accuracy <= m.ci.high
    assert retrieval_weighted_merit(cells, natural) == m  # seeded
    # natural ranks outside the swept ranks weigh nothing; none inside: no value at all
    assert retrieval_weighted_merit(cells, {"s0": 7}) is None
    assert retrieval_weighted_merit(cells, natural, resamples=0).ci is None
    # a pipeline run's records carry the natural rank: the comparison and its merit table have it
    folder = _run(tmp_path / "pipe", BASE_COUNTS)
    _edit_records(
        folder,
        lambda recs: [{**r, "extra": {"natural_rank": natural[r["sample_id"]]}} for r in recs],
    )
    cmp = compare_runs([folder, _run(tmp_path / "plain", BASE_COUNTS)])
    rw = cmp["runs"][0]["retrieval_weighted"]["vanilla"]
    assert rw["accuracy"] == pytest.approx(0.725) and "retrieval_weighted" not in cmp["runs"][1]
    table = next(t for t in comparison_tables(cmp, "merit") if t.title.startswith("retrieval"))
    assert table.rows == [["pipe:vanilla", "8 of 10", "0: 6, 2: 2", "0.725", table.rows[0][4]]]


def test_a_reorder_run_is_paired_against_its_no_reordering_curve(tmp_path):
    folder = _run(tmp_path / "pipe", BASE_COUNTS)
    other = _cells(OTHER_COUNTS)

    def with_litm(recs):
        recs = [{**r, "extra": {"gold_added": False}} for r in recs]
        return recs + [
            {**r, "cell_id": r["cell_id"] + "-litm", "strategy": "lost-in-the-middle",
             "correct": other[r["sample_id"], r["position"]]}
            for r in recs
        ]  # fmt: skip

    write_report(folder, _edit_records(folder, with_litm))
    (pair,) = compare_runs([folder])["paired"]
    # "lost-in-the-middle" sorts first, but the baseline is the run without reordering
    assert (pair["baseline"], pair["other"]) == (
        "pipe:vanilla/none",
        "pipe:vanilla/lost-in-the-middle",
    )
    assert pair["mean_diff"] == pytest.approx(0.8 / 3)


def test_answers_that_continue_the_document_list_are_counted(tmp_path):
    def copies_at_middle(sid, pos):  # 10 answers at position 1 copy the context, in two styles
        return "  Document [4](Title: X) ..." if pos == 1 else "Paris"

    def copies_once(sid, pos):
        return "Document (Title: Y) z" if (sid, pos) == ("s0", 2) else "Document 4 says Paris"

    base = _run(tmp_path / "base", BASE_COUNTS, answer=copies_at_middle, task="qa")
    other = _run(tmp_path / "cs", OTHER_COUNTS, "channel-scaled", copies_once, task="qa")
    cmp = compare_runs([base, other])
    assert [r["continued"] for r in cmp["runs"]] == [{"vanilla": 10}, {"channel-scaled": 1}]
    (merit,) = comparison_tables(cmp, "merit")
    assert merit.lines[-1] == (
        "Answers that continue the document list instead of answering (`Document [...`): "
        "base:vanilla 10 of 30; cs:channel-scaled 1 of 30."
    )
    kv = compare_runs([_run(tmp_path / "kv", BASE_COUNTS, answer=copies_at_middle)])
    assert not any("continue" in line for line in comparison_tables(kv, "merit")[0].lines)


def test_blank_answers_are_counted_and_every_qa_task_counts_continued_ones(tmp_path):
    def blank_at_end(sid, pos):  # 10 blank answers at position 2, one continues the list
        return " \n" if pos == 2 else "Document [1](Title: X)" if (sid, pos) == ("s1", 0) else "a"

    run = _run(
        tmp_path / "rep", BASE_COUNTS, answer=blank_at_end, task="qa-extractive:repeat-prompt"
    )
    cmp = compare_runs([run, _run(tmp_path / "kv", BASE_COUNTS, "pine", lambda s, p: "v")])
    assert [r["blank"] for r in cmp["runs"]] == [{"vanilla": 10}, {"pine": 0}]
    (merit,) = comparison_tables(cmp, "merit")
    assert merit.lines[-2:] == [
        "Answers that continue the document list instead of answering (`Document [...`): "
        "rep:vanilla 1 of 30; kv:pine 0 of 30.",
        "Blank answers (no text; scored wrong): rep:vanilla 10 of 30.",
    ]


def test_a_run_given_twice_is_refused(tmp_path):
    # issue 55, item 8: it was listed twice and paired with itself
    run = _run(tmp_path / "base", BASE_COUNTS)
    with pytest.raises(ConfigError, match=r"base/results.jsonl is given twice \(as .*base too\)"):
        compare_runs([run, run / "results.jsonl"])
    res = runner.invoke(app, ["report", str(run), str(run)])
    assert res.exit_code == 2 and "is given twice" in res.output


def test_overflow_samples_are_left_out_of_the_comparison(tmp_path):
    run = _run(tmp_path / "run", BASE_COUNTS)
    lines = (run / "results.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for r in recs:  # sample s9 did not fit the window at position 2: out at every position
        r["flags"] = ["overflow"] if (r["sample_id"], r["position"]) == ("s9", 2) else []
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    m = compare_runs([run])["runs"][0]["curves"]["vanilla"]
    assert (m["samples"], m["cells"]) == (9, 27)
    assert [p["accuracy"] for p in m["positions"]] == pytest.approx([8 / 9, 2 / 9, 5 / 9])


def test_not_significant_is_said_plainly(tmp_path):
    base = _run(tmp_path / "a", (5, 5))
    other = _run(tmp_path / "b", (6, 5), backend="other")
    cmp = compare_runs([base, other])
    assert cmp["paired"][0]["p_value"] == 1.0
    res = runner.invoke(app, ["report", str(base), str(other), "--out", str(tmp_path / "c.png")])
    assert "McNemar p = 1 (not significant at 0.05)" in " ".join(res.output.split())


def test_runs_with_other_cells_are_not_paired(tmp_path):
    a = _run(tmp_path / "k4", BASE_COUNTS, num_docs=4)
    b = _run(tmp_path / "k8", OTHER_COUNTS, num_docs=8, records="0:10")
    c = _run(tmp_path / "k4-lora", OTHER_COUNTS, backend="pos2distill", num_docs=4)
    cmp = compare_runs([a, b, c], plot=tmp_path / "p.png")
    assert cmp["groups"] == [["k4", "k4-lora"], ["k8"]]
    assert cmp["notes"] == ["k8 not paired with k4: num_docs 4 vs 8; records all vs 0:10"]
    assert [(p["baseline"], p["other"]) for p in cmp["paired"]] == [
        ("k4:vanilla", "k4-lora:pos2distill")
    ]
    # the same file elsewhere is the same data; another file is not
    d = _run(tmp_path / "moved", OTHER_COUNTS, backend="x", data="/y/kv.jsonl.gz", num_docs=4)
    e = _run(tmp_path / "nq", OTHER_COUNTS, backend="x", data="/x/nq.jsonl.gz", num_docs=4)
    cmp = compare_runs([a, d, e])
    assert [p["other"] for p in cmp["paired"]] == ["moved:x"]
    assert cmp["notes"] == ["nq not paired with k4: data kv.jsonl.gz vs nq.jsonl.gz"]


def test_a_run_that_tuned_on_the_compared_records_is_refused(tmp_path):
    test = _run(tmp_path / "vanilla", BASE_COUNTS, records="200:400")
    tuned_here = _run(
        tmp_path / "sink-here",
        OTHER_COUNTS,
        backend="pos2distill",
        records="200:400",
        tuned_on=[{"data": "/elsewhere/kv.jsonl.gz", "records": "150:250"}],
    )
    cmp = compare_runs([test, tuned_here])
    assert cmp["paired"] == []
    assert cmp["notes"] == [
        "sink-here:pos2distill not paired with vanilla:vanilla: sink-here tuned on records "
        "150:250 of kv.jsonl.gz, which are compared (200:400)"
    ]
    res = runner.invoke(
        app, ["report", str(test), str(tuned_here), "--out", str(tmp_path / "p.png")]
    )
    assert res.exit_code == 0 and "McNemar" not in res.output
    # tuned on a disjoint range, or on another file: paired
    for name, tuned in (
        ("disjoint", "0:200"),
        ("other-file", {"data": "q.jsonl", "records": "0:"}),
    ):
        run = _run(tmp_path / name, OTHER_COUNTS, backend="p", records="200:400", tuned_on=tuned)
        assert len(compare_runs([test, run])["paired"]) == 1
    # no records range: compared on every record, so any tuned range of the same file overlaps
    whole = _run(tmp_path / "whole", BASE_COUNTS, backend="w", tuned_on="0:10")
    assert compare_runs([_run(tmp_path / "all", BASE_COUNTS), whole])["notes"] == [
        "whole:w not paired with all:vanilla: whole tuned on records 0:10 of kv.jsonl.gz, "
        "which are compared (all)"
    ]


@pytest.mark.parametrize("bad", ["5", "10:2", "a:b", "-1:4"])
def test_malformed_record_ranges_are_named(tmp_path, bad):
    with pytest.raises(DataError, match=f"records: {bad!r} is not a record range"):
        record_range(bad, Path("run/config.json"))
    assert record_range("200:") == (200, math.inf) and record_range(None) == (0, math.inf)
    run = _run(tmp_path / "run", BASE_COUNTS, tuned_on=bad)
    res = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "p.png")])
    assert res.exit_code == 2
    assert f"config.json: tuned_on: {bad!r} is not a record range" in " ".join(res.output.split())


@pytest.mark.processes
def test_render_round_trip_and_check(tmp_path):
    base = _run(tmp_path / "runs" / "base", BASE_COUNTS)
    other = _run(tmp_path / "runs" / "lora", OTHER_COUNTS, backend="pos2distill")
    results = tmp_path / "results"
    res = runner.invoke(
        app,
        [
            "report",
            str(base),
            str(other),
            "--out",
            str(tmp_path / "p.png"),
            "--json",
            str(results / "kv.json"),
        ],
    )
    assert res.exit_code == 0, res.output
    (results / "base.json").write_text((base / "summary.json").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    doc = docs / "kv.md"
    fenced = "```\n<!-- results:merit nowhere.json -->\n<!-- /results -->\n```\n"
    doc.write_text(
        "# KV\n\n<!-- results:merit ../results/kv.json -->\nstale\n<!-- /results -->\n\ntext\n\n"
        "<!-- results:curve ../results/base.json -->\n<!-- /results -->\n" + fenced
    )
    cli = [sys.executable, "-m", "ragfix.cli", "render"]
    check = subprocess.run([*cli, "--check", str(doc)], capture_output=True, text=True)
    assert check.returncode == 1 and f"out of date: {doc}" in check.stdout
    assert runner.invoke(app, ["render", str(doc)]).exit_code == 0
    text = doc.read_text()
    assert "stale" not in text and text.endswith(fenced) and "\ntext\n" in text
    assert "| base:vanilla | 10 | 30 | 0.500 |" in text  # merit row of the comparison
    assert "| 1 | 10 | 0.200 | [0.057, 0.510] |" in text  # Wilson interval of 2 / 10
    assert runner.invoke(app, ["render", "--check", str(doc)]).exit_code == 0
    assert subprocess.run([*cli, "--check", str(doc)]).returncode == 0
    # a new result makes the file out of date
    _run(tmp_path / "runs" / "lora2", (9, 9, 9), backend="pos2distill")
    compare = runner.invoke(
        app,
        [
            "report",
            str(base),
            str(tmp_path / "runs" / "lora2"),
            "--out",
            str(tmp_path / "p.png"),
            "--json",
            str(results / "kv.json"),
        ],
    )
    assert compare.exit_code == 0
    res = runner.invoke(app, ["render", "--check", str(doc)])
    assert res.exit_code == 1 and "out of date" in res.output
    # broken blocks are one line naming the file and line
    doc.write_text("a\n<!-- results:merit ../results/kv.json -->\n")
    res = runner.invoke(app, ["render", str(doc)])
    assert res.exit_code == 2 and f"{doc}:2: results block without <!-- /results -->" in res.output
    doc.write_text("<!-- results:merit ../results/base.json -->\n<!-- /results -->\n")
    res = runner.invoke(app, ["render", str(doc)])
    assert res.exit_code == 2 and "merit tables need a comparison file" in res.output


def test_every_results_block_of_the_readme_and_docs_is_up_to_date():
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "adapters").glob("*/README.md")),
    ]
    assert ROOT / "adapters" / "smollm2-kv8-r1" / "README.md" in files
    assert render_files(files, check=True) == []


def test_benchmark_result_renders_as_its_table_and_only_as_benchmark(tmp_path):
    from ragfix.eval.results import write_benchmark
    from ragfix.tables import TableSpec

    table = TableSpec("CPU threads", ["busy", "s / cell"], [["0", "1.50"], ["1", "9.00"]], ["ok"])
    write_benchmark(tmp_path / "bench.json", table, cores=2)
    assert json.loads((tmp_path / "bench.json").read_text())["cores"] == 2
    doc = tmp_path / "b.md"
    doc.write_text("<!-- results:benchmark bench.json -->\n<!-- /results -->\n")
    render_files([doc])
    table_md = "| busy | s / cell |\n|---|---:|\n| 0 | 1.50 |\n| 1 | 9.00 |"
    assert f"**CPU threads**\n\n{table_md}\n\nok" in doc.read_text()
    doc.write_text("<!-- results:merit bench.json -->\n<!-- /results -->\n")
    with pytest.raises(DataError, match="benchmark table kind is for benchmark result files"):
        render_files([doc])


def test_report_on_a_missing_folder_names_that_folder(tmp_path):
    res = runner.invoke(app, ["report", str(tmp_path / "nothere")])
    assert res.exit_code == 2
    assert res.output.strip() == f"error: {tmp_path / 'nothere'}: no such run folder"


def test_progress_status_counts_cells_finished_before_a_resume():
    from ragfix.eval.progress import RunTally

    tally = RunTally([{"correct": True, "flags": []}, {"correct": False, "flags": ["overflow"]}])
    assert tally.status() == "acc 1.00"  # the overflowed cell is not scored
    assert tally.add({"correct": False, "flags": []}) == "acc 0.50"
    assert RunTally().status() == "no scored cell yet"


def test_a_pipe_in_a_header_or_a_cell_stays_in_its_column():
    """Markdown tables escape ``|`` in headers as in cells, so no column splits in two."""
    from ragfix.tables import TableSpec, markdown_tables

    spec = TableSpec("t", ["run", "largest |p(A) difference|"], [["a|b", "0.031"]])
    lines = [x for x in markdown_tables([spec]).splitlines() if x.startswith("|")]
    assert [len(re.findall(r"(?<!\\)\|", x)) for x in lines] == [3, 3, 3]
