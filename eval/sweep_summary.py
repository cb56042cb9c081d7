"""A sweep's summary: ``summary.json`` (one accuracy curve per backend / strategy), its tables
and where its files are.

A sweep folder holds ``results*.jsonl`` (one record per cell), ``config.json``, ``summary.json``
(:func:`build_summary`) and ``curve.png`` (:func:`ragfix.eval.plot.plot_curves`). A curve is
labelled by its backend, plus ``/strategy`` for a reorder strategy or a pipeline sweep
(:func:`curve_label`).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from ragfix.errors import DataError
from ragfix.eval.plot import plot_curves
from ragfix.io import atomic_write_json
from ragfix.metrics import CurveSummary, position_curve
from ragfix.tables import TableSpec, fmt_ci, fmt_num, fmt_signed, print_tables
from ragfix.types import EMPTY_ANSWER, UNSCORED_MEANING

RESULTS_FILE = "results.jsonl"


SUMMARY_FILE = "summary.json"


PLOT_FILE = "curve.png"

#: the reference point without passages: the task's closed-book prompt
CLOSED_BOOK = "closed-book"
#: the reference point with the gold passage alone
ORACLE = "oracle"
#: the reference points of a sweep, in the order they are reported
REFERENCES = (CLOSED_BOOK, ORACLE)


def flag_order(key: str) -> tuple[int, int]:
    """Sort key of a ``summary.json`` flags entry: the positions (``"0"``, ``"10"``) in
    numeric order, then the reference points in the order of :data:`REFERENCES`."""
    return (1, REFERENCES.index(key)) if key in REFERENCES else (0, int(key))


def curves_from_records(records: list[dict]) -> dict[str, CurveSummary]:
    """One :class:`CurveSummary` per ``backend`` / ``strategy`` label (``"vanilla"``, or
    ``"vanilla/lost-in-the-middle"`` when a reorder strategy is set); a sweep's reference
    cells (``reference`` set) are no part of any curve."""
    groups: dict[str, list[tuple[int, bool]]] = {}
    for r in on_curves(records):
        groups.setdefault(curve_label(r), []).append((int(r["position"]), bool(r["correct"])))
    return {label: position_curve(pairs) for label, pairs in sorted(groups.items())}


def on_curves(records: list[dict]) -> list[dict]:
    """The records that belong to a position curve: all but a sweep's reference points
    (``reference`` set: closed-book, oracle)."""
    return [r for r in records if not r.get("reference")]


def through_pipeline(record: dict) -> bool:
    """Whether a record comes from a pipeline sweep (its ``extra`` says whether the gold chunk
    had to be added to the retrieved ones); its ``position`` is then a retrieval rank."""
    return "gold_added" in record.get("extra", {})


def curve_label(record: dict) -> str:
    """The curve a record belongs to: its backend, plus ``/strategy`` for a record of a pipeline
    sweep (``/none`` included: no reordering is a strategy there) or any reorder strategy."""
    strategy = record.get("strategy", "none")
    if strategy == "none" and not through_pipeline(record):
        return record["backend"]
    return f"{record['backend']}/{strategy}"


def cells_by_curve(records: list[dict]) -> dict[str, dict[tuple[str, int], bool]]:
    """``{curve label: {(sample_id, position): correct}}``, for paired comparisons (reference
    cells left out)."""
    out: dict[str, dict[tuple[str, int], bool]] = {}
    for r in on_curves(records):
        out.setdefault(curve_label(r), {})[(r["sample_id"], int(r["position"]))] = bool(
            r["correct"]
        )
    return dict(sorted(out.items()))


def natural_ranks(records: list[dict]) -> dict[str, int | None] | None:
    """``{sample_id: the gold chunk's rank in the retriever's own order}`` of a pipeline sweep's
    records (``extra.natural_rank``; ``None`` where the retriever missed it), or ``None`` when
    no record carries one (a sweep over fixed passages)."""
    ranks = {
        r["sample_id"]: r["extra"]["natural_rank"]
        for r in records
        if "natural_rank" in r.get("extra", {})
    }
    return ranks or None


def build_summary(out: Path, records: list[dict], extra: dict | None = None) -> dict:
    """The ``summary.json`` content: the run's config, cell counts, curves and the ids of the
    cells it reports (``cell_ids``: those of ``records`` unless ``extra`` gives them, e.g. with
    the overflowed cells that were counted but not scored).

    ``x_axis`` is ``"prompt position"`` for raw sweeps and ``"retrieval rank"`` when a reorder
    strategy was applied.
    """
    config_path = out / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    curves = curves_from_records(records)
    ranked = any(r.get("strategy", "none") != "none" or through_pipeline(r) for r in records)
    return {
        "config": config,
        "model": config.get("model"),
        "num_docs": config.get("num_docs"),
        "task": config.get("task"),
        "x_axis": "retrieval rank" if ranked else "prompt position",
        "cells": len(records),
        "prefill_tokens": sum(r.get("prefill_tokens", 0) for r in records),
        "seconds": round(sum(r.get("seconds", 0.0) for r in records), 2),
        "curves": {k: v.model_dump() for k, v in curves.items()},
        "cell_ids": [r["cell_id"] for r in records],
        **(extra or {}),
    }


def read_summary(folder: Path) -> dict:
    """The ``summary.json`` of a run folder.

    Raises:
        DataError: no summary there, or not readable JSON.
    """
    path = Path(folder) / SUMMARY_FILE
    if not path.exists():
        from ragfix.eval.shard import shard_manifests

        if shard_manifests(folder):
            why = "it holds job shards: ragfix merge them, then run the command without --shard"
        else:
            why = f"run `ragfix eval ... --out {folder}` first"
        raise DataError(path, None, None, f"no summary ({why})")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DataError(path, None, None, f"not a ragfix summary ({e})") from None


def print_run_files(out: Path, console: Console) -> None:
    """Where a finished sweep's files are, one per line and never cut by the terminal's width
    (a path must paste back whole)."""
    for name, file in (("results", RESULTS_FILE), ("summary", SUMMARY_FILE), ("plot", PLOT_FILE)):
        console.print(f"{name}: {out / file}", soft_wrap=True, highlight=False)


def write_report(out: Path, records: list[dict], extra: dict | None = None) -> dict:
    """Write ``summary.json`` and ``curve.png`` of ``records`` into ``out`` (atomically); return
    the summary (:func:`build_summary`)."""
    summary = build_summary(out, records, extra)
    write_summary(out, summary)
    return summary


def write_summary(out: Path, summary: dict) -> None:
    """Write a built summary as ``summary.json`` (atomically) and its ``curve.png``."""
    atomic_write_json(out / SUMMARY_FILE, summary)
    plot_curves([(out.name, summary)], out / PLOT_FILE)


def curve_table(label: str, curve: dict, x_axis: str = "position") -> TableSpec:
    """Per-position table of one curve (position, n, accuracy, 95% Wilson interval) with the
    curve's mean, worst, best and gap under it.

    Args:
        label: the curve's name.
        curve: a :class:`~ragfix.metrics.CurveSummary` or
            :class:`~ragfix.eval.merit.CurveMerit` as a dict.
        x_axis: what the positions are (``prompt position`` or ``retrieval rank``).
    """
    rows = [
        [str(s["position"]), str(s["n"]), fmt_num(s["accuracy"]), fmt_ci(s)]
        for s in curve["positions"]
    ]
    line = (
        f"{label}: mean {fmt_num(curve['mean'])} | worst {fmt_num(curve['worst'])} @ "
        f"{curve['worst_position']} | best {fmt_num(curve['best'])} @ {curve['best_position']} | "
        f"gap {fmt_num(curve['gap'])}"
    )
    return TableSpec(f"{label} — {x_axis}", ["position", "n", "accuracy", "95% CI"], rows, [line])


def print_summary(summary: dict, console: Console | None = None, title: str = "") -> None:
    """The reference points (when the run has them), then per curve its per-position table
    (position, n, accuracy, 95% Wilson interval) and its mean, worst, best and gap."""
    print_tables(summary_tables(summary, title), console)


def references_table(
    references: dict[str, dict[str, dict]], ceilings: dict[str, dict] | None = None
) -> TableSpec:
    """The reference points of curves: per curve label, its samples, closed-book and oracle
    accuracy with their 95% Wilson intervals (``summary.json``'s ``references``, or a
    comparison's runs'); with ``ceilings`` (a comparison's, by curve label), each curve's worst
    position against the oracle it was set against (:func:`ragfix.eval.compare.compare_loaded`):
    its accuracy, the difference on the samples both have and the exact McNemar p, adjusted
    for having picked the worst of the curve's positions (Bonferroni). A curve without a
    reference point or a ceiling shows ``-``."""
    rows = []
    for label, by_ref in references.items():
        n = max((v["n"] for v in by_ref.values()), default=0)
        row = [label, str(n) if by_ref else "-"]
        for name in REFERENCES:
            v = by_ref.get(name)
            row.append("-" if v is None else f"{fmt_num(v['accuracy'])} {fmt_ci(v)}")
        if ceilings:
            c = ceilings.get(label)
            row += (
                ["-", "-", "-"]
                if c is None
                else [
                    f"{fmt_num(c['accuracy'])} @ {c['worst_position']}",
                    f"{fmt_signed(c['difference'])} (n {c['n']})",
                    f"{c['p']:.3g} (-{c['oracle_only']} / +{c['position_only']})",
                ]
            )
        rows.append(row)
    line = (
        "closed-book: the question alone; oracle: the gold passage alone (each curve's own, 95% "
        "Wilson intervals)."
    )
    headers = ["curve", "samples", *REFERENCES]
    if ceilings:
        bases = sorted({c["oracle"] for c in ceilings.values()})
        line += (
            f" The worst position of each curve of the same model is set against the oracle of "
            f"{', '.join(bases)} on the samples both have: the difference and the exact McNemar "
            "p (cells right only under the oracle / only at the worst position), multiplied by "
            "the number of positions the worst was picked from (Bonferroni)."
        )
        headers += ["worst @ pos", "worst - oracle", "McNemar p (adj.)"]
    return TableSpec("reference points and the ceiling", headers, rows, [line])


def summary_tables(summary: dict, title: str = "") -> list[TableSpec]:
    """The tables :func:`print_summary` prints, one per curve of a ``summary.json``."""
    x_axis = summary.get("x_axis", "position")
    tables = [references_table(summary["references"])] if summary.get("references") else []
    for label, c in summary["curves"].items():
        spec = curve_table(label, c, x_axis)
        spec.title = f"{title or label} — {x_axis}"
        tables.append(spec)
    return tables


def unscored_lines(summary: dict) -> list[str]:
    """Why cells of a ``summary.json`` are not scored, one line each: the samples left out of
    the accuracy and, per :data:`~ragfix.types.UNSCORED` flag, its cells and meaning
    (:data:`~ragfix.types.UNSCORED_MEANING`, with the server's reasons for ``empty_answer``);
    empty when every cell is scored."""
    if not summary.get("excluded_samples"):
        return []
    flags = summary.get("flags") or {}
    lines = [
        f"{summary['excluded_samples']} sample(s) have a cell that is not scored and are left "
        f"out of the accuracy at every position ({summary.get('scored_cells', 0)} of "
        f"{summary.get('cells', 0)} cells scored)"
    ]
    reasons = summary.get("empty_answer_reasons") or {}
    for flag, meaning in UNSCORED_MEANING.items():
        cells = sum((flags.get(flag) or {}).values())
        if not cells:
            continue
        said = "; ".join(f"{why}: {n}" for why, n in reasons.items())
        said = f" ({said})" if flag == EMPTY_ANSWER and said else ""
        lines.append(f"{flag}: {cells} cell(s), {meaning}{said}")
    return lines


def flags_table(summary: dict) -> TableSpec | None:
    """The flagged cells per position of a ``summary.json`` (one column per flag; a sweep's
    reference points, ``closed-book`` and ``oracle``, after the positions) with
    :func:`unscored_lines` under it; None when no cell is flagged."""
    flags = summary.get("flags") or {}
    if not flags:
        return None
    positions = sorted({p for per in flags.values() for p in per}, key=flag_order)
    rows = [[p, *(str(per.get(p, 0)) for per in flags.values())] for p in positions]
    x_axis = summary.get("x_axis", "position")
    return TableSpec(
        f"flagged cells per {x_axis}", ["position", *flags], rows, unscored_lines(summary)
    )


def print_flags(summary: dict, console: Console | None = None) -> None:
    """Print :func:`flags_table` (nothing when no cell is flagged)."""
    spec = flags_table(summary)
    if spec is not None:
        print_tables([spec], console)
