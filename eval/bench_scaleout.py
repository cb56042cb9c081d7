"""Benchmark: sweep cells per second with 1 process and with N processes (torchrun), same cells.

Each configuration runs ``ragfix eval`` from scratch into its own folder (so model loading is
counted, as a user sees it) and the answers of all runs are compared cell by cell.

    python -m ragfix.eval.bench_scaleout --processes 1,2 --limit 4 --num-docs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="nq-sample")
    ap.add_argument("--num-docs", type=int, default=3)
    ap.add_argument("--positions", default="all")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--processes", default="1,2", help="comma-separated process counts")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    common = [
        "eval",
        args.data,
        "--num-docs",
        str(args.num_docs),
        "--positions",
        args.positions,
        "--limit",
        str(args.limit),
        "--device",
        args.device,
    ]
    rows, answers = [], {}
    root = Path(tempfile.mkdtemp(prefix="ragfix-bench-scaleout-"))
    for n in [int(x) for x in args.processes.split(",")]:
        out = root / f"p{n}"
        launcher = (
            [sys.executable, "-m", "ragfix.cli"]
            if n == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(n),
                "-m",
                "ragfix.cli",
            ]
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
        t = time.perf_counter()
        subprocess.run(
            [*launcher, *common, "--out", str(out)], env=env, check=True, capture_output=True
        )
        secs = time.perf_counter() - t
        recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
        answers[n] = {r["cell_id"]: r["answer"] for r in recs}
        rows.append((n, len(recs), secs))

    base = rows[0]
    table = Table(title=f"sweep scale-out · {args.data} · {args.num_docs} docs · {args.device}")
    for col in ("processes", "cells", "wall s", "cells/s", "speed-up", "same answers as 1 proc"):
        table.add_column(col, justify="right")
    ref = answers[base[0]]
    for n, cells, secs in rows:
        same = sum(answers[n].get(k) == v for k, v in ref.items())
        table.add_row(
            str(n),
            str(cells),
            f"{secs:.1f}",
            f"{cells / secs:.3f}",
            f"{base[2] / secs:.2f}x",
            f"{same}/{len(ref)}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
