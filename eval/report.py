"""Reports of sweep results: per-position table, ``summary.json``, and the curve plot.

A run folder holds ``results*.jsonl`` (one record per cell) and ``config.json``. The summary has
one curve per (backend, strategy) found in the results; ``ragfix report runs/a runs/b`` draws
the curves of several folders on one plot.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ragfix.errors import DataError
from ragfix.io import atomic_write_bytes, atomic_write_json
from ragfix.metrics import CurveSummary, paired_comparison, position_curve

SUMMARY_FILE = "summary.json"
PLOT_FILE = "curve.png"


def progress_bar(console: Console | None = None, disable: bool = False) -> Progress:
    """The progress bar every long ragfix run shows: description, bar, done/total, a status
    field (``status=`` in ``add_task``/``update``), elapsed and remaining time. ``disable`` hides
    it (non-zero ranks of a multi-process run)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=disable,
    )


def curves_from_records(records: list[dict]) -> dict[str, CurveSummary]:
    """One :class:`CurveSummary` per ``backend`` / ``strategy`` label (``"vanilla"``, or
    ``"vanilla/lost-in-the-middle"`` when a reorder strategy is set)."""
    groups: dict[str, list[tuple[int, bool]]] = {}
    for r in records:
        groups.setdefault(curve_label(r), []).append((int(r["position"]), bool(r["correct"])))
    return {label: position_curve(pairs) for label, pairs in sorted(groups.items())}


def curve_label(record: dict) -> str:
    """The curve a record belongs to: its backend, plus ``/strategy`` for a reorder strategy."""
    strategy = record.get("strategy", "none")
    return record["backend"] if strategy == "none" else f"{record['backend']}/{strategy}"


def cells_by_curve(records: list[dict]) -> dict[str, dict[tuple[str, int], bool]]:
    """``{curve label: {(sample_id, position): correct}}``, for paired comparisons."""
    out: dict[str, dict[tuple[str, int], bool]] = {}
    for r in records:
        out.setdefault(curve_label(r), {})[(r["sample_id"], int(r["position"]))] = bool(
            r["correct"]
        )
    return dict(sorted(out.items()))


def print_paired(curves: list[tuple[str, dict]], console: Console | None = None) -> dict:
    """Compare every curve with the first on the cells they share; print one table (accuracy per
    position, the difference in brackets) and, per curve, the mean difference, the discordant
    cells and the exact McNemar p-value.

    Args:
        curves: ``(name, {(sample_id, position): correct})``, the baseline first.

    Returns:
        ``{name: PairedComparison dict}`` for every curve after the first that shares cells.
    """
    console = console or Console()
    (base_name, base), others = curves[0], curves[1:]
    results = {}
    for name, cells in others:
        try:
            results[name] = paired_comparison(base, cells)
        except ValueError:
            console.print(f"{name}: no cell in common with {base_name}; not compared")
    if not results:
        return {}
    t = Table(title=f"paired against {base_name} (same samples and positions)")
    t.add_column("position", justify="right")
    t.add_column(base_name, justify="right")
    for name in results:
        t.add_column(name, justify="right")
    positions = sorted({p.position for c in results.values() for p in c.positions})
    for pos in positions:
        row, base_acc = [str(pos)], None
        for c in results.values():
            p = next((p for p in c.positions if p.position == pos), None)
            if p is None:
                row.append("")
                continue
            base_acc = base_acc if base_acc is not None else p.baseline_correct / p.n
            row.append(
                f"{p.other_correct / p.n:.3f} ({(p.other_correct - p.baseline_correct) / p.n:+.3f})"
            )
        t.add_row(row[0], "" if base_acc is None else f"{base_acc:.3f}", *row[1:])
    console.print(t)
    for name, c in results.items():
        console.print(
            f"{name} vs {base_name}: {c.cells} cells, mean difference {c.mean_diff:+.3f}, "
            f"right only in {name} {c.only_other}, only in {base_name} {c.only_baseline}, "
            f"McNemar p = {c.p_value:.3g}",
            highlight=False,
        )
    return {name: c.model_dump() for name, c in results.items()}


def build_summary(out: Path, records: list[dict], extra: dict | None = None) -> dict:
    """The ``summary.json`` content: the run's config, cell counts and curves.

    ``x_axis`` is ``"prompt position"`` for raw sweeps and ``"retrieval rank"`` when a reorder
    strategy was applied.
    """
    config_path = out / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    curves = curves_from_records(records)
    ranked = any(r.get("strategy", "none") != "none" for r in records)
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
        **(extra or {}),
    }


def read_summary(folder: Path) -> dict:
    """The ``summary.json`` of a run folder.

    Raises:
        DataError: no summary there, or not readable JSON.
    """
    path = Path(folder) / SUMMARY_FILE
    if not path.exists():
        raise DataError(
            path, None, None, f"no summary (run `ragfix eval ... --out {folder}` first)"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DataError(path, None, None, f"not a ragfix summary ({e})") from None


def write_report(out: Path, records: list[dict], extra: dict | None = None) -> dict:
    """Write ``summary.json`` and ``curve.png`` into ``out`` (atomically); return the summary."""
    summary = build_summary(out, records, extra)
    atomic_write_json(out / SUMMARY_FILE, summary)
    plot_curves([(out.name, summary)], out / PLOT_FILE)
    return summary


def print_summary(summary: dict, console: Console | None = None, title: str = "") -> None:
    """Per-position table (position, n, accuracy, 95% Wilson interval) and each curve's mean,
    worst, best and gap."""
    console = console or Console()
    for label, c in summary["curves"].items():
        cur = CurveSummary(**c)
        t = Table(
            title=f"{title or label} — {summary.get('x_axis', 'position')}", title_justify="left"
        )
        t.add_column("position", justify="right")
        t.add_column("n", justify="right")
        t.add_column("accuracy", justify="right")
        t.add_column("95% CI", justify="right")
        for s in cur.positions:
            t.add_row(
                str(s.position), str(s.n), f"{s.accuracy:.3f}", f"[{s.low:.3f}, {s.high:.3f}]"
            )
        console.print(t)
        console.print(
            f"{label}: mean {cur.mean:.3f} | worst {cur.worst:.3f} @ {cur.worst_position} | "
            f"best {cur.best:.3f} @ {cur.best_position} | gap {cur.gap:.3f}",
            highlight=False,
        )


def plot_curves(runs: list[tuple[str, dict]], path: Path, title: str | None = None) -> None:
    """Accuracy against gold position with the 95% interval band, one line per curve of every
    run, saved as a PNG (atomically).

    Args:
        runs: ``(run label, summary dict)`` pairs.
        path: the PNG to write.
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    several = len(runs) > 1
    xlabel = "gold position"
    for run_label, summary in runs:
        xlabel = f"gold passage {summary.get('x_axis', 'position')} (0 = first)"
        for label, c in summary["curves"].items():
            cur = CurveSummary(**c)
            xs = [s.position for s in cur.positions]
            name = f"{run_label}: {label}" if several else label
            (line,) = ax.plot(xs, [s.accuracy for s in cur.positions], marker="o", label=name)
            ax.fill_between(
                xs,
                [s.low for s in cur.positions],
                [s.high for s in cur.positions],
                color=line.get_color(),
                alpha=0.15,
            )
    first = runs[0][1]
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (95% Wilson band)")
    ax.set_ylim(-0.02, 1.02)
    unit = "KV pairs" if first.get("task") == "kv" else "documents"
    ax.set_title(title or f"{first.get('model')} · {first.get('num_docs')} {unit}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
