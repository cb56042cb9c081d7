"""Sharded sweeps: torchrun on the CPU (gloo) gives exactly the single-process results."""

import json
import os
import subprocess
import sys

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
    "3",
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


def test_torchrun_two_processes_equals_single_process(tmp_path):
    single = tmp_path / "single"
    res = CliRunner().invoke(app, [*ARGS, "--out", str(single)])
    assert res.exit_code == 0, res.output

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
        *ARGS,
        "--out",
        str(dist),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]

    one, two = _records(single), _records(dist)
    assert set(one) == set(two) and len(two) == 6
    assert {k: r["answer"] for k, r in one.items()} == {k: r["answer"] for k, r in two.items()}
    ranks = [r["extra"]["rank"] for r in two.values()]
    assert sorted(set(ranks)) == [0, 1]  # both ranks worked, each cell once (keys unique)
    s1 = json.loads((single / "summary.json").read_text())["curves"]
    s2 = json.loads((dist / "summary.json").read_text())["curves"]
    assert s1 == s2

    # rank 1 "died": drop its cells; a rerun (any number of processes) redoes exactly those
    lost = [k for k, r in two.items() if r["extra"]["rank"] == 1]
    kept = [json.dumps(r) for r in two.values() if r["extra"]["rank"] == 0]
    (dist / "results.jsonl").write_text("\n".join(kept) + "\n")
    res = CliRunner().invoke(app, [*ARGS, "--out", str(dist)])
    assert res.exit_code == 0, res.output
    assert f"resuming: {6 - len(lost)} of 6 cells already done" in res.output
    assert set(_records(dist)) == set(one)
