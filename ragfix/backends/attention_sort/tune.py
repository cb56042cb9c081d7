"""The tune of attention-sort's defaults: which passage each variant would put last.

For every cell of a tune range (a sample with its gold passage at a position), the prompt and
its content-free-query form (:attr:`~ragfix.prompts.TaskPrompt.no_query`) are read once each
(:func:`~ragfix.backends.attention_sort.backend.calibrated_attention`), and every variant of
:class:`~ragfix.backends.attention_sort.AttentionSortOptions` (``layers`` x ``calibrate``, one
round) is scored from the same two readings: a hit is a cell where the variant's most attended
passage is the gold passage, so one sort round puts the gold passage last. The variant with the
best worst position (then the best mean, then the cheaper: no calibration) is the default.

With ``rounds`` R > 1, the default variant then sorts every cell R rounds
(:func:`~ragfix.backends.attention_sort.backend.sort_passages`, each round reading the prompt
as the round before left it), and a second table gives, after each round r <= R, how often the
gold passage is where ``place`` puts the most attended passage: the number of rounds with the
best worst position (then the best mean, then fewer rounds) is the ``rounds`` default.

Run: ``ragfix tune attention-sort DATA --records 0:30 --num-docs 8 --json results/NAME.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ragfix.backends.attention_sort.backend import (
    calibrated_attention,
    combine_scores,
    sort_passages,
)
from ragfix.backends.attention_sort.options import AttentionSortOptions, with_place
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


def tune_table(
    title: str, column: str, rates: dict[str, list[float]], positions: Sequence[int], line: str
) -> tuple[TableSpec, str]:
    """The table of a tune (one row per setting of ``rates``, in order: its rate per position,
    mean, worst position) and its default: the best worst position, then the best mean, then
    the earlier setting (the cheaper)."""
    names = list(rates)
    best = max(names, key=lambda n: (min(rates[n]), sum(rates[n]), -names.index(n)))
    return TableSpec(
        title=title,
        headers=[column, *(f"pos {p}" for p in positions), "mean", "worst"],
        rows=tune_rows(rates, list(positions), best),
        lines=[line],
    ), best


def placed_after_rounds(history: list[list[float]], gold: int, place: str) -> list[bool]:
    """Whether the gold passage (index ``gold``) is where ``place`` puts the most attended
    passage after each round of a sort whose per-round scores by passage index are ``history``
    (:func:`~ragfix.backends.attention_sort.backend.sort_passages`' order rule, replayed)."""
    order = list(range(len(history[0])))
    placed = []
    for scores in history:
        order = sorted(order, key=lambda i: -scores[i] if place == "first" else scores[i])
        placed.append((order[0] if place == "first" else order[-1]) == gold)
    return placed


def tune_rounds(
    backend: HFBackend,
    samples: Sequence[QASample],
    positions: Sequence[int],
    options: AttentionSortOptions,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> tuple[TableSpec, dict]:
    """After each round up to ``options.rounds``, the share of cells whose gold passage is where
    ``options.place`` (or the model's default) puts the most attended passage (see the module
    docstring).

    Returns:
        ``(table, details)``: one row per number of rounds; ``details`` holds the hits per
        round and position, the chosen ``rounds`` and each cell's placement per round.
    """
    options = with_place(options, backend.model_name)
    hits = [[0] * len(positions) for _ in range(options.rounds)]
    cells = []
    total = len(samples) * len(positions)
    for s in samples:
        for k, pos in enumerate(positions):
            prompt = task_prompt(s, s.passages_with_gold_at(pos))
            _, history = sort_passages(backend, prompt, options)
            placed = placed_after_rounds(history, pos, options.place)
            for r, hit in enumerate(placed):
                hits[r][k] += int(hit)
            cells.append({"sample": s.id, "position": pos, "placed": placed})
            progress(len(cells), total)
    names = [f"rounds={r + 1}" for r in range(options.rounds)]
    rates = {n: [h / len(samples) for h in row] for n, row in zip(names, hits, strict=True)}
    table, best = tune_table(
        f"attention-sort tune · {backend.model_name} · gold passage placed {options.place}",
        "rounds",
        rates,
        positions,
        f"{len(samples)} samples x {len(positions)} positions; layers={options.layers} "
        f"calibrate={str(options.calibrate).lower()} place={options.place}: share of cells "
        f"whose gold passage is {options.place} after each round. Default: the best worst "
        "position, then the best mean, then fewer rounds.",
    )
    details = {"hits": hits, "default": best, "cells": cells}
    return table, details


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
    table, best = tune_table(
        f"attention-sort tune · {backend.model_name} · gold passage scored highest",
        "variant",
        rates,
        positions,
        f"{len(samples)} samples x {len(positions)} positions; share of cells whose most "
        "attended passage is the gold passage (one round puts it last). Default: the best "
        "worst position, then the best mean, then no calibration.",
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


__all__ = [
    "VARIANTS",
    "placed_after_rounds",
    "tune_attention_sort",
    "tune_rounds",
    "variant_name",
]
