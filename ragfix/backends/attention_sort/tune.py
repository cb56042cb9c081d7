"""The tune of attention-sort's defaults: which passage each variant would put last.

For every cell of a tune range (a sample with its gold passage at a position), the prompt and
its content-free-query form (:attr:`~ragfix.prompts.TaskPrompt.no_query`) are read once each
(:func:`~ragfix.backends.attention_sort.backend.calibrated_attention`), and every variant of
:class:`~ragfix.backends.attention_sort.AttentionSortOptions` (``layers`` x ``calibrate``, one
round) is scored from the same two readings: a hit is a cell where the variant's most attended
passage is the gold passage, so one sort round puts the gold passage last. The variant with the
best worst position (then the best mean, then the cheaper: no calibration) is the default.

Run: ``ragfix tune attention-sort DATA --records 0:30 --num-docs 8 --json results/NAME.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ragfix.backends.attention_sort.backend import calibrated_attention, combine_scores
from ragfix.backends.attention_sort.options import AttentionSortOptions
from ragfix.backends.hf import HFBackend
from ragfix.tables import TableSpec, tune_rows
from ragfix.tasks import task_prompt
from ragfix.types import QASample

#: the variants scored, in the order of the table (the cheaper first on ties)
VARIANTS = [
    AttentionSortOptions(layers=layers, calibrate=calibrate)
    for calibrate in (False, True)
    for layers in ("upper", "all")
]


def variant_name(options: AttentionSortOptions) -> str:
    """``layers=upper calibrate=false`` (the ``--backend-opt`` spelling)."""
    return f"layers={options.layers} calibrate={str(options.calibrate).lower()}"


def tune_attention_sort(
    backend: HFBackend,
    samples: Sequence[QASample],
    positions: Sequence[int],
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> tuple[TableSpec, dict]:
    """The hit rate of every variant at every gold position (see the module docstring).

    Returns:
        ``(table, details)``: one row per variant (hits per position, mean, worst position);
        ``details`` holds the settings, the hits per variant and position, the chosen
        ``default`` and each cell's top passage per variant.
    """
    names = [variant_name(v) for v in VARIANTS]
    hits = {n: [0] * len(positions) for n in names}
    cells = []
    total = len(samples) * len(positions)
    for s in samples:
        for k, pos in enumerate(positions):
            prompt = task_prompt(s, s.passages_with_gold_at(pos))
            att, att_free = calibrated_attention(backend, prompt)
            tops = {
                n: int(combine_scores(att, att_free, v).argmax())
                for n, v in zip(names, VARIANTS, strict=True)
            }
            for n, top in tops.items():
                hits[n][k] += int(top == pos)
            cells.append({"sample": s.id, "position": pos, "top": tops})
            progress(len(cells), total)
    rates = {n: [h / len(samples) for h in hits[n]] for n in names}
    best = max(names, key=lambda n: (min(rates[n]), sum(rates[n]), -names.index(n)))
    table = TableSpec(
        title=f"attention-sort tune · {backend.model_name} · gold passage scored highest",
        headers=["variant", *(f"pos {p}" for p in positions), "mean", "worst"],
        rows=tune_rows(rates, list(positions), best),
        lines=[
            f"{len(samples)} samples x {len(positions)} positions; share of cells whose most "
            "attended passage is the gold passage (one round puts it last). Default: the best "
            "worst position, then the best mean, then no calibration."
        ],
    )
    details = {
        "model": backend.model_name,
        "positions": list(positions),
        "samples": len(samples),
        "hits": hits,
        "default": best,
        "cells": cells,
    }
    return table, details


__all__ = ["VARIANTS", "tune_attention_sort", "variant_name"]
