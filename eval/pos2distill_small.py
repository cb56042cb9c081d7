"""A CPU-sized position sweep for Pos2Distill: vanilla vs an adapter on shortened contexts.

The full sweep (``ragfix eval ... --num-docs 10 --adapter DIR``) reads ~1,300
tokens a prompt; on a shared 2-core CPU that is minutes per cell. This script runs the same
comparison on the adapter's own training size (fewer documents, passages cut to N words, the gold
passage's window keeping its answer), batched, and prints per-position accuracy with the curve's
mean, worst, best and gap (best_subspan_em, as in Lost in the Middle).

    python eval/pos2distill_small.py data/derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz \\
        --adapter adapters/smol-r1 --num-docs 5 --max-passage-words 25 --limit 40
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from ragfix.adapters import read_metadata
from ragfix.backends import load_backend
from ragfix.connectors.litm import load_samples
from ragfix.distill import shorten_sample
from ragfix.metrics import position_curve
from ragfix.tasks import score_answer, task_prompt


def sweep(backend, samples, batch_size: int) -> list[tuple[int, bool]]:
    """``(position, correct)`` for every sample and every gold position."""
    cells = [(s, p) for s in samples for p in range(s.num_docs)]
    gens = backend.generate(
        [task_prompt(s, s.passages_with_gold_at(p)) for s, p in cells], batch_size=batch_size
    )
    return [(p, score_answer(s, g.text)) for (s, p), g in zip(cells, gens, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data")
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-docs", type=int, default=5)
    ap.add_argument("--max-passage-words", type=int, default=25)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the summaries as JSON here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    meta = read_metadata(a.adapter) or {}  # None: a plain peft folder (no training record)
    samples = [
        shorten_sample(s, a.max_passage_words) for s in load_samples(a.data, a.num_docs, a.limit)
    ]
    overlap = {s.id for s in samples} & set(meta.get("train_question_ids", []))
    if overlap:
        raise SystemExit(f"{len(overlap)} evaluation questions were used for training")
    console = Console()
    table = Table(title=f"{len(samples)} questions, {a.num_docs} docs, {a.max_passage_words} words")
    table.add_column("backend")
    for p in range(a.num_docs):
        table.add_column(f"pos {p}", justify="right")
    for col in ("mean", "worst", "best", "gap", "min"):
        table.add_column(col, justify="right")
    summaries = {}
    for name, adapter in (("vanilla", None), ("pos2distill", a.adapter)):
        start = time.perf_counter()
        b = load_backend(name, model=a.model, device="cpu", adapter=adapter)
        curve = position_curve(sweep(b, samples, a.batch_size))
        minutes = (time.perf_counter() - start) / 60
        summaries[name] = {**curve.model_dump(), "minutes": round(minutes, 2)}
        table.add_row(
            name,
            *[f"{s.accuracy:.3f}" for s in curve.positions],
            f"{curve.mean:.3f}",
            f"{curve.worst:.3f} @{curve.worst_position}",
            f"{curve.best:.3f} @{curve.best_position}",
            f"{curve.gap:.3f}",
            f"{minutes:.1f}",
        )
        del b
    console.print(table)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(summaries, f, indent=2)


if __name__ == "__main__":
    main()
