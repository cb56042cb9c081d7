"""Reports of judge metrics: the two rich tables and the PNG (one row per judge)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from ragfix.io import atomic_write_bytes
from ragfix.judge.metrics import VERDICT_KINDS


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "—"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def print_judge_summary(summaries: dict[str, dict], console: Console | None = None) -> None:
    """Two tables for one or more judges (one row per judge, or per judge and verdict kind):
    position bias (position consistency with its 95% interval, preference fairness, first-slot
    win rate, tie and invalid rates), a line per judge with pairs that overflow its window, and
    agreement with the human labels (accuracy, Cohen's kappa) for each verdict kind."""
    console = console or Console()
    t = Table(title="position bias (each pair judged in both orders)", title_justify="left")
    for col in ("judge", "verdicts", "pairs", "consistency [95% CI]", "pref. fairness",
                "first-slot wins", "ties", "invalid"):  # fmt: skip
        t.add_column(
            col, justify="left" if col in ("judge", "verdicts") else "right", overflow="fold"
        )
    for name, s in summaries.items():
        for kind in ("generated", "logit"):
            m = s.get(kind)
            if m is None:
                continue
            ci = (
                f"{_fmt(m['position_consistency'])} [{_fmt(m['pc_low'])}, {_fmt(m['pc_high'])}]"
                if m["position_consistency"] is not None
                else "—"
            )
            t.add_row(
                name,
                "generated" if kind == "generated" else "logit argmax",
                str(m["pairs"]),
                ci,
                _fmt(m["preference_fairness"], signed=True),
                _fmt(m["first_slot_win_rate"]),
                _fmt(m["tie_rate"]),
                _fmt(m["invalid_rate"]),
            )
    console.print(t)
    for name, s in summaries.items():
        if s.get("overflow_pairs"):
            console.print(
                f"{name}: {s['overflow_pairs']} pair(s) overflow the context window: not judged, "
                "left out of every metric",
                highlight=False,
            )
    if not any(s["labelled"] for s in summaries.values()):
        console.print("no human labels in the data: agreement not reported")
        return
    a = Table(title="agreement with human labels", title_justify="left")
    for col in ("judge", "verdict", "n", "accuracy [95% CI]", "kappa", "ties", "invalid"):
        a.add_column(
            col, justify="left" if col in ("judge", "verdict") else "right", overflow="fold"
        )
    for name, s in summaries.items():
        for kind in VERDICT_KINDS:
            g = s["agreement"].get(kind)
            if g is None:
                continue
            a.add_row(
                name,
                kind,
                str(g["n"]),
                f"{g['accuracy']:.3f} [{g['acc_low']:.3f}, {g['acc_high']:.3f}]",
                _fmt(g["kappa"], signed=True),
                str(g["ties"]),
                str(g["invalid"]),
            )
    console.print(a)
    for kind, (_, desc) in VERDICT_KINDS.items():
        console.print(f"  {kind}: {desc}", highlight=False)


def _plot_consistency(ax, summaries: dict[str, dict]) -> None:
    """Stacked bars, one per judge and verdict source: shares of consistent pairs, pairs
    inconsistent towards the first / second slot, and pairs with an unreadable order."""
    rows = []
    for name, s in summaries.items():
        for kind in ("generated", "logit"):
            if s.get(kind) is not None:
                rows.append((name if kind == "generated" else f"{name} (logit argmax)", s[kind]))
    names = [r[0] for r in rows]
    left = [0.0] * len(rows)
    parts = [
        ("consistent", "consistent_pairs", "#2a9d8f"),
        ("favours first slot", "primacy_pairs", "#e76f51"),
        ("favours second slot", "recency_pairs", "#f4a261"),
    ]
    for label, key, color in parts:
        vals = [m[key] / m["pairs"] if m["pairs"] else 0.0 for _, m in rows]
        ax.barh(names, vals, left=left, color=color, label=label)
        for i, v in enumerate(vals):
            if v >= 0.06:
                ax.text(left[i] + v / 2, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    rest = [1.0 - x for x in left]
    ax.barh(names, rest, left=left, color="#bbbbbb", label="an order unreadable")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("share of pairs (each judged in both orders)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4)
    ax.set_title("position consistency", fontsize=10)


def _plot_agreement(ax, summaries: dict[str, dict]) -> None:
    """Grouped bars per judge: accuracy against the human labels of three verdict kinds."""
    kinds = [("single_original", "single order"), ("swap_aggregated", "swap-aggregated"),
             ("logit_calibrated", "calibrated logit")]  # fmt: skip
    judge_names = list(summaries)
    width = 0.8 / len(kinds)
    for k, (kind, label) in enumerate(kinds):
        ys, xs = [], []
        for i, name in enumerate(judge_names):
            g = summaries[name]["agreement"].get(kind)
            if g is not None:
                ys.append(i + (k - 1) * width)
                xs.append(g["accuracy"])
        if xs:
            ax.barh(ys, xs, height=width, label=label)
    ax.set_yticks(range(len(judge_names)), judge_names)
    ax.axvline(0.5, color="k", ls="--", lw=0.8)
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_xlabel("accuracy vs human labels")
    ax.set_title("agreement with humans", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)


def plot_judges(summaries: dict[str, dict], path, title: str | None = None) -> None:
    """A PNG to read at a glance, one row per judge (written atomically).

    Left: what happened to each pair across the two orders, as shares of all pairs: consistent,
    inconsistent towards the first slot, towards the second slot, an order unreadable. Right:
    accuracy against the human labels of the single-order, swap-aggregated and calibrated logit
    verdicts (dashed line: always picking one side on balanced labels).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sum(
        s.get(kind) is not None for s in summaries.values() for kind in ("generated", "logit")
    )
    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(12, 2.2 + 0.55 * rows), dpi=110, gridspec_kw={"width_ratios": [3, 2]}
    )
    _plot_consistency(ax, summaries)
    _plot_agreement(ax2, summaries)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
