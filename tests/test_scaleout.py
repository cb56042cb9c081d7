"""Sharded sweeps: torchrun ranks and the sweep's own worker processes give exactly the
single-process results; the processes benchmark and the worker-count default."""

import json
import os
import subprocess
import sys

import pytest
from conftest import BUNDLED
from typer.testing import CliRunner

from ragfix.cli.app import app
from ragfix.eval.shard import assign_groups, merge_shards

NQ = str(BUNDLED / "nq_10docs_sample.jsonl.gz")
ARGS = [
    "eval",
    NQ,
    "--num-docs",
    "3",
    "--positions",
    "first,last",
    "--limit",
    "2",
    "--device",
    "cpu",
]


def _records(out):
    lines = (out / "results.jsonl").read_text().splitlines()
    return {r["cell_id"]: r for r in map(json.loads, lines)}


def test_assign_groups_is_balanced_and_deterministic():
    groups = ["a", "b", "c", "d", "e"]
    split = assign_groups(groups, [5, 4, 3, 2, 2], groups, 2)
    assert split == [["a", "d", "e"], ["b", "c"]]  # loads 9 and 7
    assert assign_groups(groups, [5, 4, 3, 2, 2], groups, 2) == split
    assert sorted(sum(assign_groups(groups, [1] * 5, groups, 3), [])) == groups


def test_merge_tolerates_a_torn_last_line_and_duplicates(tmp_path):
    a = {"cell_id": "x", "v": 1}
    b = {"cell_id": "y", "v": 2}
    (tmp_path / "results.rank0.jsonl").write_text(json.dumps(a) + "\n" + '{"cell_id": "z", "v"')
    (tmp_path / "results.rank1.jsonl").write_text(json.dumps(b) + "\n" + json.dumps(a) + "\n")
    assert merge_shards(tmp_path) == 2
    assert _records(tmp_path) == {"x": a, "y": b}
    assert not list(tmp_path.glob("results.rank*"))


@pytest.mark.processes
def test_torchrun_ranks_and_worker_processes_equal_single_process(tmp_path, tiny_dir):
    """One single-process run, and the same run by two torchrun ranks and by two of the sweep's
    worker processes: the same cells, answers, curves and reference points (the tiny model: its
    answers differ from cell to cell, so a cell given another's answer shows)."""
    args = [*ARGS, "--model", tiny_dir]
    single = tmp_path / "single"
    res = CliRunner().invoke(app, [*args, "--workers", "1", "--out", str(single)])
    assert res.exit_code == 0, res.output
    assert len({r["answer"] for r in _records(single).values()}) > 1

    dist = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "-m",
        "ragfix.cli",
        *args,
        "--out",
        str(dist),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]

    one, two = _records(single), _records(dist)
    assert set(one) == set(two) and len(two) == 8  # 2 samples x (2 positions + 2 references)
    assert {k: r["answer"] for k, r in one.items()} == {k: r["answer"] for k, r in two.items()}
    ranks = [r["extra"]["rank"] for r in two.values()]
    assert sorted(set(ranks)) == [0, 1]  # both ranks worked, each cell once (keys unique)
    s1 = json.loads((single / "summary.json").read_text())["curves"]
    s2 = json.loads((dist / "summary.json").read_text())["curves"]
    assert s1 == s2
    refs = [json.loads((f / "summary.json").read_text())["references"] for f in (single, dist)]
    assert refs[0] == refs[1] and refs[0]["vanilla"]["oracle"]["n"] == 2

    # rank 1 "died": drop its cells; a rerun (any number of processes) redoes exactly those
    lost = [k for k, r in two.items() if r["extra"]["rank"] == 1]
    kept = [json.dumps(r) for r in two.values() if r["extra"]["rank"] == 0]
    (dist / "results.jsonl").write_text("\n".join(kept) + "\n")
    res = CliRunner().invoke(app, [*args, "--out", str(dist)])
    assert res.exit_code == 0, res.output
    assert f"resuming: {8 - len(lost)} of 8 cells already done" in res.output
    assert set(_records(dist)) == set(one)

    workers = tmp_path / "workers"
    res = CliRunner().invoke(app, [*args, "--workers", "2", "--out", str(workers)])
    assert res.exit_code == 0, res.output
    assert "2 worker processes, 1 torch thread(s) each" in res.output
    one, two = _records(single), _records(workers)
    assert len(two) == 8 and not list(workers.glob("results.rank*"))
    assert {k: r["answer"] for k, r in one.items()} == {k: r["answer"] for k, r in two.items()}
    assert sorted({r["extra"]["rank"] for r in two.values()}) == [0, 1]
    s1 = json.loads((single / "summary.json").read_text())["curves"]
    assert json.loads((workers / "summary.json").read_text())["curves"] == s1


def test_sweep_workers_default_and_errors(monkeypatch):
    import ragfix.models.device
    from ragfix.errors import ConfigError
    from ragfix.eval.shard import WORKERS_ENV, sweep_workers

    monkeypatch.delenv(WORKERS_ENV, raising=False)
    monkeypatch.delenv("RAGFIX_THREADS", raising=False)
    monkeypatch.setattr(ragfix.models.device, "free_cpu_cores", lambda: 4)
    assert sweep_workers(None, device="cpu", model="smollm2", samples=10) == 4
    assert sweep_workers(None, device="cpu", model="smollm2", samples=3) == 3  # one per sample
    monkeypatch.setenv("RAGFIX_THREADS", "2")
    assert sweep_workers(None, device="cpu", model="smollm2", samples=10) == 2  # 4 cores / 2
    assert sweep_workers(None, device="cpu", model="openai:m", samples=10) == 1
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert sweep_workers(None, device="cpu", model="smollm2", samples=10) == 3
    assert sweep_workers(1, device="cpu", model="smollm2", samples=10) == 1
    assert sweep_workers(4, device="cpu", model="smollm2", samples=2) == 2  # one per sample
    for bad, device, model in [
        (0, "cpu", "smollm2"),
        (2, "cuda", "smollm2"),
        (2, "cpu", "openai:m"),
    ]:
        with pytest.raises(ConfigError):
            sweep_workers(bad, device=device, model=model, samples=10)
    monkeypatch.setenv(WORKERS_ENV, "two")
    with pytest.raises(ConfigError, match="RAGFIX_WORKERS='two'"):
        sweep_workers(None, device="cpu", model="smollm2", samples=10)


def test_data_errors_cross_process_boundaries_intact():
    import pickle

    from ragfix.errors import DataError

    e = pickle.loads(pickle.dumps(DataError("f.jsonl", 3, "ctxs", "too few")))
    assert (str(e), e.path, e.line, e.field) == ("f.jsonl:3: ctxs: too few", "f.jsonl", 3, "ctxs")


@pytest.mark.processes
def test_bench_processes_runs_each_setting_from_scratch_and_compares_answers(tmp_path, tiny_dir):
    from ragfix.bench.scaleout import bench_processes, parse_settings

    settings = parse_settings("naive:1x1,batched:2x1")
    assert settings == [("naive", 1, 1), ("batched", 2, 1)]
    table, details = bench_processes(settings, NQ, num_docs=2, limit=2, model=tiny_dir)
    assert [r[:3] for r in table.rows] == [["naive", "1", "1"], ["batched", "2", "1"]]
    assert [r[-2:] for r in table.rows] == [["4/4", "4/4"], ["4/4", "4/4"]]
    runs = details["runs"]
    assert runs["naive 1x1"]["answers"] == runs["batched 2x1"]["answers"]
    assert len(set(runs["naive 1x1"]["answers"].values())) > 1  # the cells' answers differ
    ratio = runs["naive 1x1"]["wall_s"] / runs["batched 2x1"]["wall_s"]
    assert table.lines[-1] == f"wall time: {ratio:.2f}x less than naive 1x1 (batched 2x1)"


@pytest.mark.parametrize("bad", ["fast:1x1", "batched:2", "batched:0x1", "naive:1xT"])
def test_bench_processes_settings_are_validated(bad):
    from ragfix.bench.scaleout import parse_settings
    from ragfix.errors import ConfigError

    with pytest.raises(ConfigError, match="--settings item"):
        parse_settings(bad)
