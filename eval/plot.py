"""The accuracy-by-position plot of one or more sweeps (``curve.png``, ``ragfix report --plot``)."""

from __future__ import annotations

from pathlib import Path

from ragfix.io import atomic_write_bytes
from ragfix.metrics import CurveSummary


def plot_curves(
    runs: list[tuple[str, dict]],
    path: Path,
    title: str | None = None,
    groups: list[list[str]] | None = None,
) -> None:
    """:func:`curve_figure` saved as a PNG (atomically) at ``path``."""
    atomic_write_bytes(path, curve_figure(runs, title, groups))


def curve_figure(
    runs: list[tuple[str, dict]],
    title: str | None = None,
    groups: list[list[str]] | None = None,
    fmt: str = "png",
) -> bytes:
    """Accuracy against gold position with the 95% interval band, one line per curve of every
    run, as the bytes of a ``fmt`` file (``png``, ``svg``); a curve with reference points
    (``references`` of its summary) gets its oracle, the gold passage alone, as a dashed
    line of its colour. Runs whose cells differ (another number of passages, other data) go
    to separate panels side by side.

    Args:
        runs: ``(run label, summary dict)`` pairs.
        title: the plot's title (default: model and number of passages of each panel).
        groups: run labels per panel (default: all runs in one panel).
        fmt: the file format (matplotlib's name).
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    summaries = dict(runs)
    groups = groups or [[label for label, _ in runs]]
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.2), dpi=120, squeeze=False)
    several = len(runs) > 1
    for ax, group in zip(axes[0], groups, strict=True):
        for run_label in group:
            summary = summaries[run_label]
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
                oracle = (summary.get("references") or {}).get(label, {}).get("oracle")
                if oracle is not None:
                    ax.axhline(
                        oracle["accuracy"],
                        color=line.get_color(),
                        linestyle="--",
                        linewidth=1,
                        label=f"{name}: oracle (gold alone)",
                    )
        first = summaries[group[0]]
        ax.set_xlabel(f"gold passage {first.get('x_axis', 'position')} (0 = first)")
        ax.set_ylabel("accuracy (95% Wilson band)")
        ax.set_ylim(-0.02, 1.02)
        unit = "KV pairs" if first.get("task") == "kv" else "documents"
        panel = f"{first.get('model')} · {first.get('num_docs')} {unit}"
        ax.set_title(title if title and len(groups) == 1 else panel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_lines():  # a run without a scored cell draws no curve
            ax.legend(fontsize=8)
    if title and len(groups) > 1:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    plt.close(fig)
    return buf.getvalue()
