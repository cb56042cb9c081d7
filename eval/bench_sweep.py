"""Benchmark: the sweep's KV-cache prefix reuse against naive prefill, on the same cells.

For each sample, its cells (gold at every position) run once naively (full prefill per cell) and
once with prefix reuse, alternating sample by sample so both see the same machine load. Prints
prefill tokens, wall time, their ratios, and the share of identical answers and identical
correctness labels (any differing answer is listed).

    python -m ragfix.eval.bench_sweep --data nq-sample --num-docs 10 --limit 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ragfix.backends import load_backend
from ragfix.bundled import bundled_path
from ragfix.connectors.litm import load_samples
from ragfix.eval.sweep import SweepConfig, plan_cells, run_cells
from ragfix.models import resolve_device


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="nq-sample")
    ap.add_argument("--num-docs", type=int, default=10)
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)

    data = bundled_path(args.data) or Path(args.data)
    samples = load_samples(data, args.num_docs, args.limit)
    backend = load_backend("vanilla", model=args.model, device=args.device)
    cfg = SweepConfig(
        data=str(data),
        task=samples[0].task,
        num_docs=args.num_docs,
        model=args.model,
        backend="vanilla",
    )
    results = {"naive": {}, "prefix reuse": {}}
    wall = {"naive": 0.0, "prefix reuse": 0.0}
    console = Console()
    with console.status("running") as status:
        for i, s in enumerate(samples):
            cells = plan_cells(cfg, [s], list(range(args.num_docs)))
            for mode, reuse in (("naive", False), ("prefix reuse", True)):
                status.update(f"sample {i + 1}/{len(samples)}: {mode}")
                t = time.perf_counter()
                run_cells(
                    backend,
                    cells,
                    lambda r, m=mode: results[m].setdefault(r.cell_id, r),
                    prefix_reuse=reuse,
                )
                wall[mode] += time.perf_counter() - t

    naive, reuse = results["naive"], results["prefix reuse"]
    same_answer = sum(naive[k].answer == reuse[k].answer for k in naive)
    same_label = sum(naive[k].correct == reuse[k].correct for k in naive)
    table = Table(
        title=f"sweep prefix reuse · {args.model} · {data.name} · {args.num_docs} docs "
        f"· {len(naive)} cells · {resolve_device(args.device)}"
    )
    for col in ("mode", "prefill tokens", "wall s", "accuracy"):
        table.add_column(col, justify="right")
    for mode, recs in results.items():
        table.add_row(
            mode,
            str(sum(r.prefill_tokens for r in recs.values())),
            f"{wall[mode]:.1f}",
            f"{sum(r.correct for r in recs.values()) / len(recs):.3f}",
        )
    console.print(table)
    tok_ratio = sum(r.prefill_tokens for r in naive.values()) / sum(
        r.prefill_tokens for r in reuse.values()
    )
    console.print(
        f"prefill tokens: {tok_ratio:.2f}x fewer | "
        f"wall time: {wall['naive'] / wall['prefix reuse']:.2f}x less | "
        f"identical answers {same_answer}/{len(naive)} | "
        f"identical correctness labels {same_label}/{len(naive)}"
    )
    for k in naive:
        if naive[k].answer != reuse[k].answer:
            console.print(
                f"differs @ position {naive[k].position}: "
                f"{naive[k].answer!r} vs {reuse[k].answer!r}"
            )


if __name__ == "__main__":
    main()
