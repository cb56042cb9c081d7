"""Tables as data, rendered two ways: with rich on a console and as GitHub Markdown.

Every table ragfix shows (a sweep's curve, a comparison, a benchmark, perplexity, a judge run, a
calibration) is a :class:`TableSpec` built once from its result and rendered by
:func:`print_tables` or :func:`markdown_tables`; the number formats are the helpers below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table


@dataclass
class TableSpec:
    """One table as data, printed with rich (:func:`print_tables`) or as Markdown
    (:func:`markdown_tables`): a title, column headers, rows of formatted cells, and lines shown
    under it. A spec without headers is only its lines."""

    title: str
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def fmt_num(x: float) -> str:
    """``0.4213`` -> ``"0.421"`` (three decimals)."""
    return f"{x:.3f}"


def fmt_signed(x: float) -> str:
    """``0.05`` -> ``"+0.050"`` (three decimals, sign always shown)."""
    return f"{x:+.3f}"


def fmt_ci(iv: dict | None, signed: bool = False) -> str:
    """An interval ``{"low": a, "high": b}`` as ``"[a, b]"`` (three decimals, signed when
    ``signed``); ``"n/a"`` for None."""
    if iv is None:
        return "n/a"
    fmt = fmt_signed if signed else fmt_num
    return f"[{fmt(iv['low'])}, {fmt(iv['high'])}]"


def tune_rows(rates: dict[str, list[float]], positions: list[int], best: str) -> list[list[str]]:
    """The rows of a tune table: per setting (``best`` marked ``(default)``), its rate at each
    position, the mean and the worst position (``0.400 @ 4``; the first of equals)."""
    rows = []
    for name, row in rates.items():
        worst = min(range(len(positions)), key=lambda i: row[i])
        rows.append(
            [
                name + (" (default)" if name == best else ""),
                *(fmt_num(x) for x in row),
                fmt_num(sum(row) / len(positions)),
                f"{fmt_num(row[worst])} @ {positions[worst]}",
            ]
        )
    return rows


def print_tables(tables: list[TableSpec], console: Console | None = None) -> None:
    """Print ``tables`` with rich (first column left-aligned, the others right-aligned); the
    text is printed as it is, never read as rich markup (a label ``gali[chunk_size=64]`` keeps
    its brackets)."""
    console = console or Console()
    for spec in tables:
        if spec.headers:
            t = Table(title=escape(spec.title), title_justify="left")
            for i, h in enumerate(spec.headers):
                t.add_column(escape(h), justify="left" if i == 0 else "right", overflow="fold")
            for row in spec.rows:
                t.add_row(*map(escape, row))
            console.print(t)
        for line in spec.lines:
            console.print(line, highlight=False, soft_wrap=True, markup=False)


def markdown_tables(tables: list[TableSpec]) -> str:
    """``tables`` as GitHub Markdown: a bold title, a pipe table (first column left-aligned, the
    others right-aligned), and its lines as paragraphs."""
    parts = []
    for spec in tables:
        if spec.headers:
            table = [
                "| " + " | ".join(h.replace("|", "\\|") for h in spec.headers) + " |",
                "|---|" + "---:|" * (len(spec.headers) - 1),
                *(
                    "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
                    for row in spec.rows
                ),
            ]
            parts.append(f"**{spec.title}**\n\n" + "\n".join(table))
        parts.extend(spec.lines)
    return "\n\n".join(parts)
