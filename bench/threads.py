"""Benchmark: seconds per sweep cell for torch CPU thread counts, on an idle machine and beside
processes that keep cores busy, on the same cells.

Each (busy processes, threads) setting runs the same cells in a fresh child process (the embedded
model, the bundled KV sample, gold at every position, one cell at a time as the sweep runs them
without prefix reuse); the busy processes are pure-Python spin loops started beside it, standing
for another job on the machine. Prints seconds per cell, the ratio against the fastest setting of
the same load, and whether every setting gave the same answers; writes the table as a result file
(``--json results/cpu-threads.json``, rendered by ``ragfix render``). The thread count
:func:`ragfix.models.device.cpu_threads` picks by default is the measured winner of each load: the
cores the load leaves free.

    ragfix bench threads --threads 1,2 --busy 0,1 --json results/cpu-threads.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

from ragfix.tables import TableSpec


def _spin() -> None:
    """Keep one core busy until killed, or until the bench that started it is gone."""
    from ragfix.models.device import exit_with_parent

    exit_with_parent()
    while True:
        pass


def _child(threads: int, limit: int, num_docs: int) -> dict:
    """Run the cells with ``threads`` torch threads; wall seconds per cell and the answers."""
    from ragfix.backends import load_backend
    from ragfix.bundled import bundled_path
    from ragfix.connectors.litm import load_samples
    from ragfix.eval.sweep import SweepConfig, plan_cells, run_cells

    os.environ["RAGFIX_THREADS"] = str(threads)
    data = bundled_path("kv-sample")
    samples = load_samples(data, num_docs, limit)
    backend = load_backend("vanilla", device="cpu")
    cfg = SweepConfig(
        data=str(data), task=samples[0].task, num_docs=num_docs, model="smollm2", backend="vanilla"
    )
    cells = plan_cells(cfg, samples, list(range(num_docs)))
    answers: dict[str, str] = {}
    run_cells(backend, cells[:1], lambda r: None, prefix_reuse=False)  # warm-up, not timed
    t = time.perf_counter()
    run_cells(backend, cells, lambda r: answers.setdefault(r.cell_id, r.answer), prefix_reuse=False)
    return {"seconds_per_cell": (time.perf_counter() - t) / len(cells), "answers": answers}


def bench_threads(
    threads: list[int], busy: list[int], limit: int = 1, num_docs: int = 8, on_progress=None
) -> tuple[TableSpec, dict]:
    """Seconds per cell for each (busy processes, torch threads) setting, each in a fresh child
    process (see the module docstring).

    Returns:
        ``(table, details)``: the formatted table and the raw figures (seconds per cell and the
        answers of every setting, the number of cores).
    """
    from ragfix.models.device import parent_death_signal, usable_cpu_cores

    cores = usable_cpu_cores()
    runs: dict[tuple[int, int], dict] = {}
    for b in busy:
        spinners = [mp.Process(target=_spin, daemon=True) for _ in range(b)]
        for p in spinners:
            p.start()
        try:
            for t in threads:
                cmd = [sys.executable, "-m", "ragfix.bench.threads", "--child", str(t)]
                cmd += ["--limit", str(limit), "--num-docs", str(num_docs)]
                ends = parent_death_signal()
                out = subprocess.run(
                    cmd, check=True, capture_output=True, text=True, preexec_fn=ends
                ).stdout
                runs[b, t] = json.loads(out.strip().splitlines()[-1])
                if on_progress is not None:
                    took = runs[b, t]["seconds_per_cell"]
                    on_progress(f"busy {b}, threads {t}: {took:.2f} s/cell")
        finally:
            for p in spinners:
                p.kill()
    first = next(iter(runs.values()))["answers"]
    same = all(r["answers"] == first for r in runs.values())
    rows = []
    for (b, t), r in runs.items():
        best = min(v["seconds_per_cell"] for (b2, _), v in runs.items() if b2 == b)
        secs = r["seconds_per_cell"]
        rows.append([str(b), str(t), f"{secs:.2f}", f"{secs / best:.2f}x", str(max(1, cores - b))])
    table = TableSpec(
        f"CPU threads · SmolLM2 · KV {num_docs} pairs · {len(first)} cells · {cores} cores",
        ["busy processes", "torch threads", "s / cell", "vs fastest at this load", "default picks"],
        rows,
        [f"identical answers in every setting: {'yes' if same else 'no'}"],
    )
    details = {"cores": cores, "runs": {f"busy {b}, threads {t}": r for (b, t), r in runs.items()}}
    return table, details


def main(argv: list[str] | None = None) -> None:
    """The child process of :func:`bench_threads` (``--child THREADS``); ``ragfix bench
    threads`` is the command."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--num-docs", type=int, default=8)
    ap.add_argument("--child", type=int, required=True)
    args = ap.parse_args(argv)
    print(json.dumps(_child(args.child, args.limit, args.num_docs)))


if __name__ == "__main__":
    main()
