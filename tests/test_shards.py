"""Job shards (``--shard I/N``) of every run kind, joined by ``ragfix merge``: the merged run
equals the single run cell by cell (answers, verdicts, perplexities), with the refusals that keep
a merge from passing off part of a run, another run's cells or a changed model as the whole."""

import json
import shutil

import pytest
from conftest import BUNDLED, data_file
from typer.testing import CliRunner

from ragfix.cli.app import app

runner = CliRunner()
SWEEP = ["eval", str(BUNDLED / "nq_10docs_sample.jsonl.gz"), "--num-docs", "3"]
SWEEP += ["--positions", "first,last", "--limit", "3", "--no-references", "--device", "cpu"]
SWEEP += ["--workers", "1"]


def _cli(*args, code: int = 0) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == code, res.output
    return " ".join(res.output.split())


def _cells(out, name: str = "results", key: str = "cell_id") -> dict[str, dict]:
    """Every record of every result file of ``out`` (a shard's, ranks', or merged), by cell."""
    recs = {}
    for p in sorted(out.glob(f"{name}*.jsonl")):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            recs.setdefault(r[key], r)
    return recs


def _answers(cells: dict[str, dict]) -> dict:
    return {cid: (r["answer"], r["correct"]) for cid, r in cells.items()}


@pytest.fixture(scope="module")
def sweep(tiny_dir) -> list[str]:
    """:data:`SWEEP` on the tiny model (a mechanism: its answers are garbage, but they differ
    from cell to cell, so a cell given another's answer shows); ``[:-2]`` drops ``--workers 1``."""
    return [*SWEEP[:-2], "--model", tiny_dir, *SWEEP[-2:]]


@pytest.fixture(scope="module")
def single(tmp_path_factory, sweep):
    """The sweep run whole, in one process."""
    out = tmp_path_factory.mktemp("single") / "run"
    _cli(*sweep, "--out", out)
    assert len({answer for answer, _ in _answers(_cells(out)).values()}) > 1
    return out


def test_sweep_shards_in_their_own_folders_merge_to_the_single_run(single, sweep, tmp_path):
    s0, s1, merged = tmp_path / "s0", tmp_path / "s1", tmp_path / "merged"
    said = _cli(*sweep, "--out", s0, "--shard", "0/2")
    assert "shard 0/2:" in said and "(of the run's 6)" in said
    _cli(*sweep, "--out", s1, "--shard", "1/2")
    # a shard stores its part in its own file and writes no summary
    assert (s0 / "results.shard0of2.jsonl").exists() and (s0 / "shard0of2.json").exists()
    assert not (s0 / "summary.json").exists() and not (s1 / "summary.json").exists()
    assert "it holds job shards: ragfix merge them" in _cli("report", s0, code=2)
    part0, part1 = _cells(s0), _cells(s1)
    assert part0 and part1 and not set(part0) & set(part1)
    # whole samples: the positions of a sample share its prompt prefix
    assert not {r["sample_id"] for r in part0.values()} & {r["sample_id"] for r in part1.values()}
    assert set(part0) | set(part1) == set(_cells(single))

    said = _cli("merge", merged, s0, s1)
    assert "merged 2 shards from 2 folder(s): 6 cells" in said
    said = _cli(*sweep, "--out", merged)
    assert "resuming: 6 of 6 cells already done" in said
    assert _answers(_cells(merged)) == _answers(_cells(single))
    mine, theirs = (json.loads((d / "summary.json").read_text()) for d in (merged, single))
    assert mine["curves"] == theirs["curves"]

    # a merge that would pass part of a run, or another run's cells, off as the whole is refused
    assert "shard(s) 1/2 missing" in _cli("merge", tmp_path / "m2", s0, code=2)
    short = tmp_path / "short"
    shutil.copytree(s1, short)
    lines = (short / "results.shard1of2.jsonl").read_text().splitlines()
    (short / "results.shard1of2.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    said = _cli("merge", tmp_path / "m3", s0, short, code=2)
    assert f"shard 1/2 in {short} has {len(lines) - 1} of its {len(lines)} cells: rerun it" in said
    other = tmp_path / "other"
    shutil.copytree(s1, other)
    config = json.loads((other / "config.json").read_text())
    config["identity"]["model"]["weights"] = "files:0000000000000000"  # run on other weights
    (other / "config.json").write_text(json.dumps(config))
    said = _cli("merge", tmp_path / "m4", s0, other, code=2)
    assert "ran another configuration" in said and "identity.model.weights" in said
    assert not (tmp_path / "m3").exists() and not (tmp_path / "m4").exists()
    # a job that read the data file from another path (another machine's checkout): the same
    # content is the same run; other content is not
    moved = tmp_path / "moved"
    shutil.copytree(s1, moved)
    config = json.loads((moved / "config.json").read_text())
    config["data"] = str(tmp_path / "elsewhere" / "nq_10docs_sample.jsonl.gz")
    (moved / "config.json").write_text(json.dumps(config))
    assert "merged 2 shards from 2 folder(s): 6 cells" in _cli("merge", tmp_path / "m7", s0, moved)
    config["inputs"]["data"] = "0" * 16
    (moved / "config.json").write_text(json.dumps(config))
    said = _cli("merge", tmp_path / "m8", s0, moved, code=2)
    assert "ran another configuration" in said and "inputs.data" in said and "; data:" in said
    # a shard of another split of the run
    said = _cli(*sweep, "--out", tmp_path / "s3", "--shard", "1/3")
    said = _cli("merge", tmp_path / "m5", s0, tmp_path / "s3", code=2)
    assert "the shards split different runs" in said
    assert "no shard manifest" in _cli("merge", tmp_path / "m6", single, code=2)


@pytest.mark.processes
def test_sweep_shards_in_one_folder_with_worker_processes(single, sweep, tmp_path):
    """Jobs on a shared file system write one folder; a shard's worker processes write their own
    files; the unsharded command over the folder summarises it without merging first."""
    shared = tmp_path / "shared"
    _cli(*sweep[:-2], "--workers", "2", "--out", shared, "--shard", "1/2")  # two samples
    assert sorted(p.name for p in shared.glob("results*")) == [
        "results.shard1of2.rank0.jsonl",
        "results.shard1of2.rank1.jsonl",
    ]
    _cli(*sweep, "--out", shared, "--shard", "0/2")
    said = _cli(*sweep, "--out", shared)
    assert "resuming: 6 of 6 cells already done" in said
    assert sorted(p.name for p in shared.glob("results*")) == ["results.jsonl"]
    assert _answers(_cells(shared)) == _answers(_cells(single))


def test_shard_settings_are_refused_in_one_line(tmp_path):
    said = _cli(*SWEEP, "--out", tmp_path / "x", "--shard", "2/2", code=2)
    assert "--shard 2/2: give I/N with N >= 1 and 0 <= I < N" in said
    assert "give I/N, e.g. 0/4" in _cli(*SWEEP, "--out", tmp_path / "x", "--shard", "1", code=2)
    said = _cli(*SWEEP, "--out", tmp_path / "x", "--shard", "0/2", "--gate", "worst>=0.1", code=2)
    assert "--gate checks a whole run" in said
    said = _cli(*SWEEP, "--out", tmp_path / "x", "--shard", "0/2", "--restart", code=2)
    assert "--restart with --shard: start the run over once" in said
    assert not (tmp_path / "x").exists()
    (tmp_path / "empty").mkdir()
    said = _cli("merge", tmp_path / "m", tmp_path / "empty", code=2)
    assert "config.json: not found: not a run folder" in said


def test_judge_shards_merge_to_the_single_run(tmp_path, tiny_dir):
    judge = ["judge", data_file("llmbar_pairs.jsonl.gz"), "--limit", "3", "--device", "cpu"]
    judge += ["--model", tiny_dir]
    _cli(*judge, "--out", tmp_path / "single")
    shared = tmp_path / "shared"
    for i in range(2):
        assert f"shard {i}/2:" in _cli(*judge, "--out", shared, "--shard", f"{i}/2")
    assert "3 cells" in _cli("merge", shared, shared)
    assert "resuming: 3 of 3" in _cli(*judge, "--out", shared)
    mine, theirs = (_cells(d, "judgments", "pair_id") for d in (shared, tmp_path / "single"))
    assert len(mine) == 3
    # the tiny model's p_a are about 1 / vocabulary: a relative tolerance, at which every
    # order of every pair has its own p_a (a record of another pair or order shows)
    p_as = [r[order]["p_a"] for r in theirs.values() for order in ("original", "swapped")]
    assert all(p != pytest.approx(q, rel=1e-4) for i, p in enumerate(p_as) for q in p_as[:i])
    for pid, r in theirs.items():
        for order in ("original", "swapped"):
            assert mine[pid][order]["raw"] == r[order]["raw"]
            # other batches (pairs padded together): fp32 rounding, not another verdict
            assert mine[pid][order]["p_a"] == pytest.approx(r[order]["p_a"], rel=1e-4)


def test_ppl_shards_merge_to_the_single_run(tmp_path, tiny_dir):
    essay = tmp_path / "essay.jsonl"
    from test_ppl import ESSAY

    essay.write_text(json.dumps({"text": ESSAY}) + "\n")
    ppl = ["eval-ppl", essay, "--train-window", "64", "--ratios", "1", "--methods", "vanilla,gali"]
    ppl += ["--samples", "2", "--device", "cpu", "--model", tiny_dir]
    _cli(*ppl, "--out", tmp_path / "single")
    for i in range(2):
        _cli(*ppl, "--out", tmp_path / f"s{i}", "--shard", f"{i}/2")
    assert "4 cells" in _cli("merge", tmp_path / "merged", tmp_path / "s0", tmp_path / "s1")
    _cli(*ppl, "--out", tmp_path / "merged")
    mine, theirs = (
        json.loads((tmp_path / d / "ppl.json").read_text()) for d in ("merged", "single")
    )
    assert [r["ppl"] for r in mine["rows"]] == pytest.approx([r["ppl"] for r in theirs["rows"]])
    # the tiny model's two windows differ in NLL: a window's cell in place of the other shows
    for r in theirs["rows"]:
        assert r["window_nll"][0] != pytest.approx(r["window_nll"][1])


def test_pipeline_shards_merge_to_the_single_run(tmp_path, tiny_dir):
    from test_needles import DOCS

    corpus = tmp_path / "docs"
    for name, text in DOCS.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(text)
    pipe = ["eval-pipeline", "--corpus", corpus, "--needles", "3", "--num-docs", "3"]
    pipe += ["--positions", "0,2", "--device", "cpu", "--model", tiny_dir]
    _cli(*pipe, "--out", tmp_path / "single")
    for i in range(2):
        _cli(*pipe, "--out", tmp_path / f"s{i}", "--shard", f"{i}/2")
    _cli("merge", tmp_path / "merged", tmp_path / "s0", tmp_path / "s1")
    assert "resuming: 6 of 6" in _cli(*pipe, "--out", tmp_path / "merged")
    assert _answers(_cells(tmp_path / "merged")) == _answers(_cells(tmp_path / "single"))
    # the tiny model's answers differ from cell to cell: a cell given another's answer shows
    assert len({answer for answer, _ in _answers(_cells(tmp_path / "single")).values()}) > 1
