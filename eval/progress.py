"""What a long run shows while it works: the progress bar and a sweep's running accuracy."""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ragfix.types import UNSCORED


class RunTally:
    """The running accuracy a sweep's progress bar shows, over the run's scored cells: the cells
    finished before a resume count too, so a resumed run shows the whole run's accuracy.

    Args:
        done: records already stored (dicts with ``correct`` and ``flags``).
    """

    def __init__(self, done: Iterable[dict] = ()) -> None:
        self.right = self.scored = 0
        for r in done:
            self.add(r)

    def add(self, record: dict) -> str:
        """Count one stored cell (``correct``, ``flags``; one with an
        :data:`~ragfix.types.UNSCORED` flag is not scored, nor a sweep's reference point, which
        is no part of a curve); return :meth:`status`."""
        if record.get("reference"):
            return self.status()
        if not UNSCORED.intersection(record.get("flags", ())):
            self.scored += 1
            self.right += bool(record["correct"])
        return self.status()

    def status(self) -> str:
        """``"acc 0.42"``, or ``"no scored cell yet"``."""
        return f"acc {self.right / self.scored:.2f}" if self.scored else "no scored cell yet"


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
