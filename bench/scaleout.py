"""Benchmark: the same sweep in one process or several, from scratch, as a user runs it.

Each setting is ``MODE:PxT``: ``naive`` (every cell prefilled alone and decoded alone:
``--no-prefix-reuse --batch-size 1``) or ``batched`` (the default sweep: the cells of a sample
prefilled along their token trie, then decoded in one batch), in ``P`` worker processes
(``ragfix eval --workers P``) of ``T`` torch threads each (``ragfix --threads T``). Every setting
runs ``ragfix eval`` in a fresh child process into its own folder, so imports and model loading
are counted, one setting after the other on the same machine. Prints wall seconds, cells per
second, the ratio against the first setting and the answers compared with it cell by cell; the
last line is the wall-time ratio of the fastest setting with the first setting's labels on every
cell. ``ragfix bench processes --json results/NAME.json`` keeps the table as a result file.

    ragfix bench processes --settings naive:1x2,batched:1x2,batched:2x1 --limit 2
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragfix.errors import ConfigError
from ragfix.models.device import parent_death_signal
from ragfix.tables import TableSpec

#: the ``ragfix eval`` flags of each mode
MODE_FLAGS = {"naive": ["--no-prefix-reuse", "--batch-size", "1"], "batched": []}


def parse_settings(text: str) -> list[tuple[str, int, int]]:
    """``"naive:1x2,batched:2x1"`` to ``[("naive", 1, 2), ("batched", 2, 1)]``.

    Raises:
        ConfigError: an unknown mode or a count that is not a whole number of at least 1.
    """
    out = []
    for item in (x.strip() for x in text.split(",")):
        mode, _, shape = item.partition(":")
        procs, _, threads = shape.partition("x")
        if mode not in MODE_FLAGS or not (procs.isdigit() and threads.isdigit()):
            raise ConfigError(
                f"--settings item {item!r}: expected MODE:PxT with MODE one of "
                f"{', '.join(MODE_FLAGS)} and whole numbers P, T (e.g. batched:2x1)"
            )
        if int(procs) < 1 or int(threads) < 1:
            raise ConfigError(f"--settings item {item!r}: P and T must be at least 1")
        out.append((mode, int(procs), int(threads)))
    return out


def bench_processes(
    settings: list[tuple[str, int, int]],
    data: str = "nq-sample",
    num_docs: int = 10,
    limit: int = 2,
    model: str = "smollm2",
    on_progress=None,
) -> tuple[TableSpec, dict]:
    """Run the same sweep cells under every setting (see the module docstring), on the CPU.

    Args:
        settings: ``(mode, processes, threads)`` triples (:func:`parse_settings`); the first is
            the baseline of the ratios.
        data: a Lost-in-the-Middle QA or KV file, or a bundled sample name.
        num_docs: documents (or KV pairs) per prompt; every position is a cell.
        limit: samples (``limit x num_docs`` cells per setting).
        model: the model (vanilla backend).
        on_progress: called with a short status line after each setting.

    Returns:
        ``(table, details)``: the formatted table and the raw figures (per setting: wall
        seconds, the answers and labels by cell id).

    Raises:
        subprocess.CalledProcessError: a setting's ``ragfix eval`` failed (its stderr attached).
    """
    from ragfix.models.device import usable_cpu_cores

    root = Path(tempfile.mkdtemp(prefix="ragfix-bench-processes-"))
    runs: dict[str, dict] = {}
    for mode, procs, threads in settings:
        name = f"{mode} {procs}x{threads}"
        out = root / name.replace(" ", "-")
        cmd = [sys.executable, "-m", "ragfix.cli", "--threads", str(threads), "eval", data]
        cmd += ["--num-docs", str(num_docs), "--positions", "all", "--limit", str(limit)]
        cmd += ["--no-references"]  # the curve's cells: what the settings are compared on
        cmd += ["--model", model, "--device", "cpu", "--workers", str(procs), "--out", str(out)]
        t = time.perf_counter()
        subprocess.run(
            [*cmd, *MODE_FLAGS[mode]],
            check=True,
            capture_output=True,
            text=True,
            preexec_fn=parent_death_signal(),
        )
        wall = time.perf_counter() - t
        recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        runs[name] = {
            "mode": mode,
            "processes": procs,
            "threads": threads,
            "wall_s": round(wall, 2),
            "answers": {r["cell_id"]: r["answer"] for r in recs},
            "correct": {r["cell_id"]: r["correct"] for r in recs},
        }
        if on_progress is not None:
            on_progress(f"{name}: {wall:.1f} s")
    base_name, base = next(iter(runs.items()))
    rows, exact = [], []
    for name, r in runs.items():
        same_answers = sum(r["answers"].get(k) == v for k, v in base["answers"].items())
        same_labels = sum(r["correct"].get(k) == v for k, v in base["correct"].items())
        if name != base_name and same_labels == len(base["correct"]):
            exact.append(name)
        rows.append(
            [
                r["mode"],
                str(r["processes"]),
                str(r["threads"]),
                f"{r['wall_s']:.1f}",
                f"{len(r['answers']) / r['wall_s']:.3f}",
                f"{base['wall_s'] / r['wall_s']:.2f}x",
                f"{same_labels}/{len(base['correct'])}",
                f"{same_answers}/{len(base['answers'])}",
            ]
        )
    lines = ["each setting from scratch in a fresh process (imports and model loading counted)"]
    if exact:
        best = min(exact, key=lambda n: runs[n]["wall_s"])
        ratio = base["wall_s"] / runs[best]["wall_s"]
        lines.append(f"wall time: {ratio:.2f}x less than {base_name} ({best})")
    else:
        lines.append(f"wall time: no setting gave {base_name}'s labels on every cell")
    cores = usable_cpu_cores()
    title = (
        f"sweep processes · {model} · {Path(data).name} · {num_docs} docs · "
        f"{len(base['answers'])} cells · cpu · {cores} cores"
    )
    headers = ["mode", "processes", "threads each", "wall s", "cells/s", "vs first"]
    headers += ["labels as first", "answers as first"]
    details = {"data": data, "num_docs": num_docs, "samples": limit, "cores": cores, "runs": runs}
    return TableSpec(title, headers, rows, lines), details
