"""Reports of sweep results: per-position tables, ``summary.json``, the curve plot, and the
comparison of several runs (``ragfix report``).

A run folder holds ``results*.jsonl`` (one record per cell), ``config.json`` and ``summary.json``.
The summary has one curve per (backend, strategy) found in the results.

Comparing runs (:func:`compare_runs`): every curve gets its figures of merit (mean, worst
position, best-worst gap, with 95% intervals; :mod:`ragfix.eval.merit`). Runs are *paired* (the
difference per position, the exact McNemar p-value, paired bootstrap intervals) only when their
``config.json`` agree on every field of :data:`CELL_FIELDS` (data, task, number of passages,
record range and prompt layout), so that a cell key (sample, position) means the same prompt in
both; runs that differ only in model, backend or adapter are paired. Other runs are drawn side by
side (one plot panel per group of comparable runs) with a one-line note naming the differing
fields (``num_docs 4 vs 8``). A run that tuned on the records it is compared on (``tuned_on`` in
its ``config.json``) is never paired either.

Every table exists once, as a :class:`TableSpec`, printed with rich or written as Markdown
(``ragfix report --markdown``, and the ``results`` blocks of :mod:`ragfix.eval.render`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ragfix.errors import ConfigError, DataError, RagfixError
from ragfix.eval.merit import (
    ALPHA,
    N_RESAMPLES,
    SEED,
    Bootstrap,
    Cells,
    curve_merit,
    paired_merit,
    significance,
)
from ragfix.io import CONFIG_FILE, atomic_write_bytes, atomic_write_json
from ragfix.metrics import CurveSummary, continues_context, position_curve
from ragfix.types import OVERFLOW

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "curve.png"
#: the ``kind`` of a comparison file written by ``ragfix report --json``
COMPARISON_KIND = "ragfix-comparison"
#: ``"kind"`` of a benchmark's result file (:func:`write_benchmark`)
BENCHMARK_KIND = "ragfix-benchmark"
#: ``"kind"`` of a perplexity result file (``ragfix eval-ppl``, :func:`ragfix.eval.ppl.run_ppl`)
PPL_KIND = "ragfix-ppl"
#: ``"kind"`` of a judge run's ``summary.json`` (``ragfix judge``, :mod:`ragfix.eval.judge_run`)
JUDGE_KIND = "ragfix-judge"
#: ``"format"`` of a judge summary computed from other judges' verdicts (``--from-judgments``;
#: the swap-judgments format of :mod:`ragfix.connectors.pairwise`)
SWAP_JUDGMENTS_FORMAT = "swap_judgments"
#: ``config.json`` fields that decide what a cell (sample, position) is: the data and the
#: content of every input file (``inputs``), the task, the passages per prompt, the record range
#: and the prompt layout (distractors; a pipeline's corpus, questions, retriever, chunking and
#: framework). Runs are paired only when they agree on all of them (a field absent from both
#: agrees).
CELL_FIELDS = (
    "data",
    "inputs",
    "task",
    "num_docs",
    "records",
    "distractor_pool",
    "corpus",
    "questions",
    "retriever",
    "chunk_size",
    "framework",
)
#: fields holding file paths, compared by file name (runs made on another machine still pair;
#: their contents are compared by ``inputs``)
PATH_FIELDS = ("data", "distractor_pool", "corpus", "questions")


class RunTally:
    """The running accuracy a sweep's progress bar shows, over the run's scored cells: the cells
    finished before a resume count too, so a resumed run shows the whole run's accuracy.

    Args:
        done: records already stored (dicts with ``correct`` and ``flags``).
    """

    def __init__(self, done: Iterable[dict] = ()) -> None:
        self.right = self.scored = 0
        for r in done:
            self.add(bool(r["correct"]), r.get("flags", ()))

    def add(self, correct: bool, flags: Iterable[str]) -> str:
        """Count one cell (an overflowed one is not scored); return :meth:`status`."""
        if OVERFLOW not in flags:
            self.scored += 1
            self.right += correct
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


def curves_from_records(records: list[dict]) -> dict[str, CurveSummary]:
    """One :class:`CurveSummary` per ``backend`` / ``strategy`` label (``"vanilla"``, or
    ``"vanilla/lost-in-the-middle"`` when a reorder strategy is set)."""
    groups: dict[str, list[tuple[int, bool]]] = {}
    for r in records:
        groups.setdefault(curve_label(r), []).append((int(r["position"]), bool(r["correct"])))
    return {label: position_curve(pairs) for label, pairs in sorted(groups.items())}


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
    """``{curve label: {(sample_id, position): correct}}``, for paired comparisons."""
    out: dict[str, dict[tuple[str, int], bool]] = {}
    for r in records:
        out.setdefault(curve_label(r), {})[(r["sample_id"], int(r["position"]))] = bool(
            r["correct"]
        )
    return dict(sorted(out.items()))


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
        raise DataError(
            path, None, None, f"no summary (run `ragfix eval ... --out {folder}` first)"
        )
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


@dataclass
class TableSpec:
    """One table as data, printed with rich (:func:`print_tables`) or as Markdown
    (:func:`markdown_tables`): a title, column headers, rows of formatted cells, and lines shown
    under it. A spec without headers is only its lines."""

    title: str
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _f(x: float) -> str:
    return f"{x:.3f}"


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def _ci(iv: dict | None, signed: bool = False) -> str:
    if iv is None:
        return "n/a"
    fmt = _signed if signed else _f
    return f"[{fmt(iv['low'])}, {fmt(iv['high'])}]"


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
        [str(s["position"]), str(s["n"]), _f(s["accuracy"]), _ci(s)] for s in curve["positions"]
    ]
    line = (
        f"{label}: mean {_f(curve['mean'])} | worst {_f(curve['worst'])} @ "
        f"{curve['worst_position']} | best {_f(curve['best'])} @ {curve['best_position']} | "
        f"gap {_f(curve['gap'])}"
    )
    return TableSpec(f"{label} — {x_axis}", ["position", "n", "accuracy", "95% CI"], rows, [line])


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
                "| " + " | ".join(spec.headers) + " |",
                "|---|" + "---:|" * (len(spec.headers) - 1),
                *(
                    "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
                    for row in spec.rows
                ),
            ]
            parts.append(f"**{spec.title}**\n\n" + "\n".join(table))
        parts.extend(spec.lines)
    return "\n\n".join(parts)


def print_summary(summary: dict, console: Console | None = None, title: str = "") -> None:
    """Per-position table (position, n, accuracy, 95% Wilson interval) and each curve's mean,
    worst, best and gap."""
    print_tables(summary_tables(summary, title), console)


def summary_tables(summary: dict, title: str = "") -> list[TableSpec]:
    """The tables :func:`print_summary` prints, one per curve of a ``summary.json``."""
    x_axis = summary.get("x_axis", "position")
    tables = []
    for label, c in summary["curves"].items():
        spec = curve_table(label, c, x_axis)
        spec.title = f"{title or label} — {x_axis}"
        tables.append(spec)
    return tables


@dataclass
class Run:
    """A finished run folder read for a comparison.

    Attributes:
        name: its label in tables (the folder name; the path as given when names repeat).
        folder: the run folder.
        config: its ``config.json`` (``{}`` when it has none).
        summary: its ``summary.json``.
        curves: ``{curve label: {(sample_id, position): correct}}``, of the scored cells only
            (:func:`ragfix.eval.sweep.summary_counts`: no sample with an overflow cell).
        continued: ``{curve label: answers that continue the context}``
            (:func:`ragfix.metrics.continues_context`), over the same cells.
    """

    name: str
    folder: Path
    config: dict
    summary: dict
    curves: dict[str, Cells]
    continued: dict[str, int]


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Read a run folder (or a file inside one): its config, summary and the cells its run
    reported (the ``cell_ids`` of its ``summary.json``; a folder may hold more cells, e.g. of a
    run with a larger ``--limit`` before, or of an interrupted extension).

    Raises:
        DataError: no such folder, no ``summary.json``, a summary written before summaries
            listed their cells, an unreadable ``config.json`` / ``summary.json``, a malformed
            ``records`` / ``tuned_on`` in it, a reported cell missing from the results, or no
            scored cell.
    """
    from ragfix.eval.sweep import open_store, summary_counts  # sweep imports this module

    path = Path(path)
    if not path.exists():
        raise DataError(path, None, None, "no such run folder")
    folder = path if path.is_dir() else path.parent
    summary = read_summary(folder)
    config_path = folder / CONFIG_FILE
    config = summary.get("config") or {}
    if config_path.exists():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as e:
            raise DataError(
                config_path, None, None, f"unreadable run configuration ({e})"
            ) from None
    ids = summary.get("cell_ids")
    if not isinstance(ids, list):
        raise DataError(
            folder / SUMMARY_FILE,
            None,
            "cell_ids",
            "written by an earlier ragfix that did not list the run's cells: rerun its "
            "`ragfix eval` command with --restart",
        )
    stored = open_store(folder).load()
    missing = [i for i in ids if i not in stored]
    if missing:
        raise DataError(
            folder / RESULTS_FILE,
            None,
            None,
            f"{len(missing)} of the {len(ids)} cells its summary reports are not in the results "
            f"(first: {missing[0]}): rerun its `ragfix eval` command",
        )
    records, _ = summary_counts([stored[i] for i in ids])
    curves = cells_by_curve(records)
    continued = dict.fromkeys(curves, 0)
    for r in records:
        continued[curve_label(r)] += continues_context(r.get("answer", ""))
    run = Run(name or folder.name, folder, config, summary, curves, continued)
    if not run.curves:
        raise DataError(folder, None, None, "no scored cell in this run (nothing to compare)")
    record_range(config.get("records"), config_path)
    tuned_ranges(run)
    return run


def uneven_positions(cells: Cells) -> str | None:
    """A one-line note when the positions of a curve cover different samples (``n`` per
    position differs, or the same ``n`` of other samples), so its points are not comparable;
    None when every position has the same samples."""
    by_pos: dict[int, set[str]] = {}
    for sample, pos in cells:
        by_pos.setdefault(pos, set()).add(sample)
    if len({frozenset(s) for s in by_pos.values()}) <= 1:
        return None
    counts = ", ".join(f"{p}: {len(s)}" for p, s in sorted(by_pos.items()))
    return f"its positions cover different samples (samples per position {counts})"


def _file_key(value):
    """A path setting cut to its file name."""
    return Path(value).name if isinstance(value, str) else value


def _setting(name: str, config: dict):
    value = config.get(name)
    if name == "records":  # canonical; the whole file is "all" (checked by load_run)
        start, stop = record_range(value)
        if stop == math.inf:
            return "all" if start == 0 else f"{start}:"
        return f"{start}:{stop}"
    return _file_key(value) if name in PATH_FIELDS else value


def config_differences(a: dict, b: dict) -> list[str]:
    """The :data:`CELL_FIELDS` on which two run configurations differ, as ``"num_docs 4 vs 8"``
    (paths as file names, an absent field as ``none``); ``[]`` when their cells are the same."""
    out = []
    for name in CELL_FIELDS:
        x, y = _setting(name, a), _setting(name, b)
        if x != y:
            out.append(f"{name} {'none' if x is None else x} vs {'none' if y is None else y}")
    return out


def record_range(value, where: Path | None = None, field_name: str = "records") -> tuple:
    """A record range of a ``config.json`` (``"A:B"``, parsed by
    :func:`ragfix.eval.sweep.parse_records`) as ``(start, stop)``; ``None``, ``""`` or ``"all"``
    is every record ``(0, inf)``, and so is an open end.

    Raises:
        DataError: not a record range (names ``where`` and the field).
    """
    from ragfix.eval.sweep import parse_records  # sweep imports this module

    if value is None or str(value).strip() in ("", "all"):
        return 0, math.inf
    try:
        rng = parse_records(str(value))
    except ConfigError:
        raise DataError(where, None, field_name, f"{value!r} is not a record range 'A:B'") from None
    return rng.start or 0, math.inf if rng.stop is None else rng.stop


def tuned_ranges(run: Run) -> list[tuple[str, tuple, str]]:
    """The record ranges ``run`` made choices on, from ``tuned_on`` in its ``config.json``:
    a list (or one) of ``{"data": FILE, "records": "A:B"}`` or of ``"A:B"`` (the run's own data
    file). Returns ``(file name, (start, stop), "A:B")`` triples.

    Raises:
        DataError: an entry of another form, or a malformed range.
    """
    raw = run.config.get("tuned_on")
    if raw is None:
        return []
    where = run.folder / CONFIG_FILE
    out = []
    for item in raw if isinstance(raw, list) else [raw]:
        if isinstance(item, str):
            data, records = run.config.get("data"), item
        elif isinstance(item, dict) and "records" in item:
            data, records = item.get("data", run.config.get("data")), item["records"]
        else:
            raise DataError(
                where,
                None,
                "tuned_on",
                f"{item!r}: expected 'A:B' or {{'data': ..., 'records': 'A:B'}}",
            )
        out.append((_file_key(data), record_range(records, where, "tuned_on"), str(records)))
    return out


def tuned_conflict(tuner: Run, compared: Run) -> str | None:
    """A one-line reason when ``tuner`` made its choices on records of the data ``compared``
    is measured on (same file name, overlapping ranges); None when they are disjoint."""
    data = _setting("data", compared.config)
    used = record_range(compared.config.get("records"), compared.folder / CONFIG_FILE)
    shown = compared.config.get("records") or "all"
    for file, (start, stop), text in tuned_ranges(tuner):
        if file == data and max(start, used[0]) < min(stop, used[1]):
            return f"{tuner.name} tuned on records {text} of {file}, which are compared ({shown})"
    return None


def _label(run: Run, curve: str) -> str:
    return f"{run.name}:{curve}"


def compare_runs(
    paths: list[str | Path],
    *,
    plot: str | Path | None = None,
    title: str | None = None,
    resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> dict:
    """Compare run folders: figures of merit of every curve, and paired comparisons where the
    cells are the same (issue 15's protocol).

    Runs are grouped by :func:`config_differences` (a run joins the first group whose first run
    has the same cells); in each group every curve is paired with the group's first curve, unless
    one of the two runs tuned on the compared records (:func:`tuned_conflict`) or they share no
    cell. Every curve not paired gets a one-line note saying why.

    Args:
        paths: run folders (or files in them); the first one's first curve is the baseline.
        plot: draw every curve into this PNG, one panel per group of runs with the same cells.
        title: the plot's title.
        resamples, seed: bootstrap settings (:mod:`ragfix.eval.merit`).

    Returns:
        The comparison (the JSON ``ragfix report --json`` writes): ``kind``, ``bootstrap``,
        ``alpha``, ``runs`` (name, path, config, x axis and every curve's
        :class:`~ragfix.eval.merit.CurveMerit`), ``groups`` (run names), ``paired`` (``baseline``
        and ``other`` labels plus a :class:`~ragfix.eval.merit.PairedMerit`) and ``notes``.

    Raises:
        DataError: a folder without a readable summary, or a malformed ``tuned_on`` / ``records``.
    """
    names = [Path(p).name if Path(p).is_dir() else Path(p).parent.name for p in paths]
    runs = [
        load_run(p, n if names.count(n) == 1 else str(p)) for p, n in zip(paths, names, strict=True)
    ]
    groups: list[list[Run]] = []
    notes: list[str] = []
    for run in runs:
        for curve, cells in run.curves.items():
            uneven = uneven_positions(cells)
            if uneven:
                notes.append(f"{_label(run, curve)}: {uneven}")
        group = next((g for g in groups if _same_cells(g[0], run)), None)
        if group is not None:
            group.append(run)
            continue
        if groups:
            first = groups[0][0]
            why = "; ".join(_differences(first, run))
            notes.append(f"{run.name} not paired with {first.name}: {why}")
        groups.append([run])
    paired = []
    for group in groups:
        base_run = group[0]
        base_curve, base_cells = next(iter(base_run.curves.items()))
        base = _label(base_run, base_curve)
        for run in group:
            for curve, cells in run.curves.items():
                other = _label(run, curve)
                if other == base:
                    continue
                why = tuned_conflict(run, base_run) or tuned_conflict(base_run, run)
                if why is None:
                    try:
                        merit = paired_merit(base_cells, cells, resamples=resamples, seed=seed)
                    except RagfixError:
                        why = "no (sample, position) cell in common"
                    else:
                        paired.append({"baseline": base, "other": other, **merit.model_dump()})
                if why is not None:
                    notes.append(f"{other} not paired with {base}: {why}")
    if plot is not None:
        plot_curves(
            [(r.name, r.summary) for r in runs],
            Path(plot),
            title,
            [[r.name for r in g] for g in groups],
        )
    return {
        "kind": COMPARISON_KIND,
        "bootstrap": Bootstrap(resamples=resamples, seed=seed).model_dump(),
        "alpha": ALPHA,
        "runs": [
            {
                "name": r.name,
                "path": str(r.folder),
                "config": r.config,
                "x_axis": r.summary.get("x_axis", "prompt position"),
                "curves": {
                    c: curve_merit(cells, resamples=resamples, seed=seed).model_dump()
                    for c, cells in r.curves.items()
                },
                "continued": r.continued,
            }
            for r in runs
        ],
        "groups": [[r.name for r in g] for g in groups],
        "paired": paired,
        "notes": notes,
    }


def _differences(a: Run, b: Run) -> list[str]:
    missing = [r.name for r in (a, b) if not r.config]
    if missing:
        return [f"no {CONFIG_FILE} in {', '.join(missing)}"]
    return config_differences(a.config, b.config)


def _same_cells(a: Run, b: Run) -> bool:
    return a is b or not _differences(a, b)


#: table kinds of a comparison (``ragfix report`` prints ``comparison``: all of them), of a
#: benchmark, of a perplexity result and of a judge run
TABLE_KINDS = ("curve", "merit", "paired", "comparison", "benchmark", "ppl", "judge")
#: table kinds that render one kind of result file only, and the only kind for that file:
#: table kind -> (the file's ``kind``, what the file is in an error message)
_FILE_TABLE_KINDS = {
    "benchmark": (BENCHMARK_KIND, "benchmark"),
    "ppl": (PPL_KIND, "perplexity"),
    "judge": (JUDGE_KIND, "judge"),
}


def write_benchmark(path: str | Path, table: TableSpec, **details) -> dict:
    """Write a benchmark's table (cells already formatted) as a result file under ``results/``,
    with the details of the run (settings, raw figures) beside it; atomic.

    Returns:
        The written object (``"kind": "ragfix-benchmark"``, rendered by the ``benchmark`` table
        kind).
    """
    result = {
        "kind": BENCHMARK_KIND,
        "title": table.title,
        "headers": table.headers,
        "rows": table.rows,
        "lines": table.lines,
        **details,
    }
    atomic_write_json(path, result)
    return result


def comparison_tables(comparison: dict, kind: str = "comparison") -> list[TableSpec]:
    """The tables of a comparison (:func:`compare_runs`) or of a wrapped ``summary.json``
    (:func:`load_result`).

    Args:
        kind: ``curve`` (per-position table of every curve), ``merit`` (figures of merit of every
            curve), ``paired`` (per-position differences and McNemar p of every pair, then the
            notes on runs not paired), ``comparison`` (all three); ``benchmark`` for a
            benchmark's file (:func:`write_benchmark`), ``ppl`` for a perplexity result
            (:func:`ppl_tables`), ``judge`` for a judge run's ``summary.json``
            (:func:`judge_tables`).

    Raises:
        DataError: ``merit`` or ``paired`` asked of a ``summary.json`` (they need the cells: use
            ``ragfix report RUN --json FILE``); ``benchmark``, ``ppl`` or ``judge`` asked of
            another file, or another kind asked of their files.
    """
    if kind not in TABLE_KINDS:
        raise RagfixError(f"unknown table kind {kind!r} (one of: {', '.join(TABLE_KINDS)})")
    for table_kind, (file_kind, what) in _FILE_TABLE_KINDS.items():
        if (kind == table_kind) != (comparison.get("kind") == file_kind):
            raise DataError(
                comparison.get("source"),
                None,
                None,
                f"the {table_kind} table kind is for {what} result files, and only for them",
            )
    if kind == "benchmark":
        keys = ("title", "headers", "rows", "lines")
        return [TableSpec(**{k: comparison[k] for k in keys})]
    if kind == "ppl":
        return ppl_tables(comparison)
    if kind == "judge":
        return judge_tables(comparison)
    if kind in ("merit", "paired") and comparison.get("kind") != COMPARISON_KIND:
        raise DataError(
            comparison.get("source"),
            None,
            None,
            f"{kind} tables need a comparison file (`ragfix report RUN... --json FILE`)",
        )
    tables: list[TableSpec] = []
    if kind in ("curve", "comparison"):
        for run in comparison["runs"]:
            several = len(comparison["runs"]) > 1 or comparison.get("kind") == COMPARISON_KIND
            for c, curve in run["curves"].items():
                tables.append(
                    curve_table(f"{run['name']}:{c}" if several else c, curve, run["x_axis"])
                )
    if kind in ("merit", "comparison"):
        tables.append(_merit_table(comparison))
    if kind in ("paired", "comparison"):
        tables += [_paired_table(p, comparison) for p in comparison["paired"]]
        if comparison["notes"]:
            tables.append(TableSpec("not paired", lines=list(comparison["notes"])))
    return tables


def _ppl_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _ppl_ci(iv: dict | None, digits: int = 2) -> str:
    return "n/a" if iv is None else f"[{iv['low']:.{digits}f}, {iv['high']:.{digits}f}]"


def ppl_tables(result: dict) -> list[TableSpec]:
    """The tables of a perplexity result (:func:`ragfix.eval.ppl.run_ppl`, ``ppl.json``).

    Two tables, one row per (method, length): perplexity with its 95% interval over windows, over
    the last quarter of each window, and the ratio to the baseline's perplexity with its paired
    interval (when the result has a baseline); then perplexity by query kind (tokens predicted
    from a query at an interpolated vs a whole-number position ID) with the token counts. A line
    under them says what the windows and intervals are.
    """
    rows = result["rows"]
    base = result.get("baseline")
    headers = ["method", "length", "x L", "ppl", "95% CI", "last quarter"]
    if base:
        headers += [f"ppl / {base}", "95% CI (paired)"]
    main, kinds = [], []
    for r in rows:
        cells = [
            r["method"],
            str(r["length"]),
            f"{r['ratio']:g}",
            _ppl_cell(r["ppl"]),
            _ppl_ci(r["ppl_ci"]),
            _ppl_cell(r["ppl_tail"]),
        ]
        if base:
            vs = r.get("vs_baseline")
            cells += (
                [f"{vs['ppl_ratio']:.3f}", _ppl_ci(vs["ppl_ratio_ci"], 3)] if vs else ["—", "—"]
            )
        main.append(cells)
        kinds.append(
            [
                r["method"],
                str(r["length"]),
                str(r["tokens_interp"]),
                _ppl_cell(r["ppl_interp"]),
                str(r["tokens_whole"]),
                _ppl_cell(r["ppl_whole"]),
            ]
        )
    start, stop = result["windows"]
    boot = result["bootstrap"]
    line = (
        f"{result['model']}, L = {result['train_window']}, {stop - start} text windows "
        f"({start} to {stop - 1}) of {result['window_tokens']} tokens from {result['data']}, "
        f"length tokens read from each. 95% intervals: {boot['method']} bootstrap "
        f"over windows ({boot['resamples']} resamples, seed {boot['seed']}) of the mean NLL per "
        "token, exponentiated"
        + (f"; ppl / {base}: exp of the mean per-window NLL difference, paired." if base else ".")
    )
    kind_headers = [
        "method",
        "length",
        "tokens from interpolated queries",
        "ppl",
        "tokens from whole-number queries",
        "ppl",
    ]
    return [
        TableSpec("Perplexity by length", headers, main),
        TableSpec(
            "Perplexity by query position ID (tokens summed over windows)",
            kind_headers,
            kinds,
            [line],
        ),
    ]


def _pc(m: dict) -> str:
    """Position consistency with its counts: ``0.928 (389/419)`` (consistent / both orders read)."""
    pc = m["position_consistency"]
    return f"{'n/a' if pc is None else _f(pc)} ({m['consistent_pairs']}/{m['valid_pairs']})"


def _rate(x: float | None, signed: bool = False) -> str:
    return "n/a" if x is None else _signed(x) if signed else _f(x)


def _acc_kappa(g: dict | None) -> str:
    """``accuracy / kappa`` of one verdict kind's agreement (``n/a`` without labels)."""
    return "n/a" if g is None else f"{_f(g['accuracy'])} / {_rate(g['kappa'], signed=True)}"


def judge_tables(result: dict) -> list[TableSpec]:
    """The tables of a judge run's ``summary.json`` (``ragfix judge``,
    :mod:`ragfix.eval.judge_run`; ``"kind": "ragfix-judge"``).

    A summary of other judges' verdicts (``ragfix judge --from-judgments``) is one table, one row
    per judge: position consistency with its counts (consistent / pairs both of whose verdicts
    were read), preference fairness, first-slot win rate, invalid rate, and accuracy / Cohen's
    kappa against the human labels of the single-order (original order) and swap-aggregated
    verdicts.

    A judged run (a model as the judge) is two tables per judge: position bias per verdict source
    (generated verdicts, per-order argmax of the letter probabilities): consistency with its
    counts, fairness, first-slot wins, tie and invalid rates, with the mean probability of the
    verdict letters (and the repetition stability, the run's notes) under it; then agreement with
    the human labels per verdict kind (n, accuracy with its 95% Wilson interval, kappa, ties,
    invalid), or a line saying the data has no labels.
    """
    data = Path(result["data"]).name
    limit = result.get("limit")
    judges = result["judges"]
    if result.get("format") == SWAP_JUDGMENTS_FORMAT:
        rows = [
            [
                name,
                _pc(s["generated"]),
                _rate(s["generated"]["preference_fairness"], signed=True),
                _rate(s["generated"]["first_slot_win_rate"]),
                _rate(s["generated"]["invalid_rate"]),
                _acc_kappa(s["agreement"].get("single_original")),
                _acc_kappa(s["agreement"].get("swap_aggregated")),
            ]
            for name, s in judges.items()
        ]
        headers = [
            "judge",
            "PC (consistent/read)",
            "PF",
            "first-slot wins",
            "invalid",
            "single-order acc / κ",
            "swap-aggregated acc / κ",
        ]
        items = f"first {limit} items" if limit is not None else "all items"
        line = (
            f"{data}, {items} of each judge. Single order: the verdict of the order given in the "
            "file; swap-aggregated: both orders, an inconsistent pair is a tie (MT-bench)."
        )
        title = f"Other judges' verdicts in both orders ({items})"
        return [TableSpec(title, headers, rows, [line])]
    tables = []
    for name, s in judges.items():
        where = f"{data}, first {limit} pairs" if limit is not None else data
        rows = []
        for source, label in (("generated", "generated"), ("logit", "logit argmax")):
            m = s.get(source)
            if m is not None:
                rows.append(
                    [
                        label,
                        str(m["pairs"]),
                        _pc(m),
                        _rate(m["preference_fairness"], signed=True),
                        _rate(m["first_slot_win_rate"]),
                        _rate(m["tie_rate"]),
                        _rate(m["invalid_rate"]),
                    ]
                )
        headers = [
            "verdicts",
            "pairs",
            "PC (consistent/read)",
            "PF",
            "first-slot wins",
            "ties",
            "invalid",
        ]
        lines = []
        if s.get("letter_mass") is not None:
            lines.append(f"Mean p(A) + p(B) at the verdict position: {_f(s['letter_mass'])}.")
        if s.get("repetition_stability") is not None:
            lines.append(f"Repetition stability: {_f(s['repetition_stability'])}.")
        lines += list(result.get("notes", []))
        tables.append(TableSpec(f"{name} as judge: position bias ({where})", headers, rows, lines))
        agree = [
            [
                kind,
                str(g["n"]),
                _f(g["accuracy"]),
                _ci({"low": g["acc_low"], "high": g["acc_high"]}),
                _rate(g["kappa"], signed=True),
                str(g["ties"]),
                str(g["invalid"]),
            ]
            for kind, g in s["agreement"].items()
            if g is not None
        ]
        title = f"{name} as judge: agreement with human labels ({where})"
        if agree:
            headers = ["verdict", "n", "accuracy", "95% CI", "κ", "ties", "invalid"]
            tables.append(TableSpec(title, headers, agree))
        else:
            tables.append(TableSpec(title, lines=["No human labels in the data."]))
    return tables


def _merit_table(comparison: dict) -> TableSpec:
    boot = comparison["bootstrap"]
    rows = []
    for run in comparison["runs"]:
        for c, m in run["curves"].items():
            rows.append(
                [
                    f"{run['name']}:{c}",
                    str(m["samples"]),
                    str(m["cells"]),
                    _f(m["mean"]),
                    _ci(m["mean_ci"]),
                    f"{_f(m['worst'])} @ {m['worst_position']}",
                    _ci(m["worst_ci"]),
                    f"{_f(m['best'])} @ {m['best_position']}",
                    _f(m["gap"]),
                    _ci(m["gap_ci"]),
                ]
            )
    headers = [
        "curve",
        "samples",
        "cells",
        "mean",
        "95% CI",
        "worst @ pos",
        "95% CI",
        "best @ pos",
        "gap",
        "95% CI",
    ]
    line = (
        f"95% intervals: Wilson at the worst position; {boot['method']} bootstrap over samples "
        f"({boot['resamples']} resamples, seed {boot['seed']}) for mean and gap."
    )
    lines = [line]
    counts = [
        f"{run['name']}:{c} {run['continued'][c]} of {m['cells']}"
        for run in comparison["runs"]
        if "continued" in run  # comparison files written before the count existed lack it
        for c, m in run["curves"].items()
    ]
    if any(run.get("config", {}).get("task") == "qa" for run in comparison["runs"]) and counts:
        lines.append(
            "Answers that continue the document list instead of answering "
            f"(`Document [...`): {'; '.join(counts)}."
        )
    return TableSpec("figures of merit", headers, rows, lines)


def _paired_table(pair: dict, comparison: dict) -> TableSpec:
    base, other = pair["baseline"], pair["other"]
    rows = [
        [
            str(p["position"]),
            str(p["n"]),
            _f(p["baseline"]),
            _f(p["other"]),
            _signed(p["diff"]),
            str(p["only_other"]),
            str(p["only_baseline"]),
            f"{p['p_value']:.3g}",
            significance(p["p_value"]),
        ]
        for p in pair["positions"]
    ]
    headers = [
        "position",
        "n",
        base,
        other,
        "difference",
        f"right only in {other}",
        f"right only in {base}",
        "McNemar p",
        f"at {comparison['alpha']}",
    ]
    line = (
        f"{other} vs {base}: {pair['cells']} cells ({pair['samples']} samples), mean difference "
        f"{_signed(pair['mean_diff'])} {_ci(pair['mean_diff_ci'], True)}, gap difference "
        f"{_signed(pair['gap_diff'])} {_ci(pair['gap_diff_ci'], True)}, right only in {other} "
        f"{pair['only_other']}, only in {base} {pair['only_baseline']}, McNemar p = "
        f"{pair['p_value']:.3g} ({significance(pair['p_value'])} at {comparison['alpha']})"
    )
    return TableSpec(
        f"{other} paired with {base} (same samples and positions)", headers, rows, [line]
    )


def load_result(path: str | Path) -> dict:
    """A result file as a comparison: a comparison, benchmark, perplexity or judge JSON as it is
    (its ``kind`` field says which), or a run's ``summary.json`` wrapped as a one-run comparison
    (curves without bootstrap intervals, nothing paired).

    Raises:
        DataError: missing, unreadable, or none of these files.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(path, None, None, f"cannot read the result file ({e.strerror})") from None
    except ValueError as e:
        raise DataError(path, None, None, f"not JSON ({e})") from None
    kinds = (COMPARISON_KIND, BENCHMARK_KIND, PPL_KIND, JUDGE_KIND)
    if isinstance(data, dict) and data.get("kind") in kinds:
        return {**data, "source": str(path)}
    if not isinstance(data, dict) or not isinstance(data.get("curves"), dict):
        raise DataError(path, None, None, "neither a summary.json nor a comparison file")
    run = {
        "name": path.stem,
        "path": str(path.parent),
        "config": data.get("config", {}),
        "x_axis": data.get("x_axis", "prompt position"),
        "curves": data["curves"],
    }
    return {"kind": "summary", "source": str(path), "runs": [run], "paired": [], "notes": []}


def write_comparison(path: str | Path, comparison: dict) -> None:
    """Write a comparison (:func:`compare_runs`) as indented JSON, atomically."""
    atomic_write_json(path, comparison)


def plot_curves(
    runs: list[tuple[str, dict]],
    path: Path,
    title: str | None = None,
    groups: list[list[str]] | None = None,
) -> None:
    """Accuracy against gold position with the 95% interval band, one line per curve of every
    run, saved as a PNG (atomically). Runs whose cells differ (another number of passages, other
    data) go to separate panels side by side.

    Args:
        runs: ``(run label, summary dict)`` pairs.
        path: the PNG to write.
        title: the plot's title (default: model and number of passages of each panel).
        groups: run labels per panel (default: all runs in one panel).
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
        first = summaries[group[0]]
        ax.set_xlabel(f"gold passage {first.get('x_axis', 'position')} (0 = first)")
        ax.set_ylabel("accuracy (95% Wilson band)")
        ax.set_ylim(-0.02, 1.02)
        unit = "KV pairs" if first.get("task") == "kv" else "documents"
        panel = f"{first.get('model')} · {first.get('num_docs')} {unit}"
        ax.set_title(title if title and len(groups) == 1 else panel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title and len(groups) > 1:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
