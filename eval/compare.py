"""The comparison of several sweep folders (``ragfix report``).

Every curve gets its figures of merit (mean, worst position, best-worst gap, with 95% intervals;
:mod:`ragfix.eval.merit`). Runs are *paired* (the difference per position, the exact McNemar
p-value, paired bootstrap intervals) only when their ``config.json`` agree on every field of
:data:`CELL_FIELDS` (data, number of passages, record range and prompt layout), so that a
cell key (sample, position) means the same sample with the gold passage at the same position;
runs that differ only in model, backend, adapter or task form (``--task``, ``--repeat``) are
paired. Other runs are drawn side by side (one plot panel per group of
comparable runs) with a one-line note naming the differing fields (``num_docs 4 vs 8``). A run
that tuned on the records it is compared on (``tuned_on`` in its ``config.json``) is never paired
either.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ragfix.connectors.records import parse_records
from ragfix.errors import ConfigError, DataError, RagfixError
from ragfix.eval.merit import (
    ALPHA,
    N_RESAMPLES,
    SEED,
    Bootstrap,
    Cells,
    curve_merit,
    paired_merit,
    retrieval_weighted_merit,
    significance,
)
from ragfix.eval.plot import plot_curves
from ragfix.eval.sweep import (
    ORACLE,
    open_store,
    reference_cells,
    reference_points,
    split_scored,
)
from ragfix.eval.sweep_summary import (
    RESULTS_FILE,
    SUMMARY_FILE,
    cells_by_curve,
    curve_label,
    curve_table,
    natural_ranks,
    read_summary,
    references_table,
    unscored_lines,
)
from ragfix.io import CONFIG_FILE, atomic_write_json
from ragfix.metrics import continues_context, mcnemar_exact
from ragfix.models.resolve import DEFAULT_EMBEDDER
from ragfix.tables import TableSpec, fmt_ci, fmt_num, fmt_signed
from ragfix.tasks import REPEAT_SUFFIX, run_task, task_names

#: the ``kind`` of a comparison file written by ``ragfix report --json``
COMPARISON_KIND = "ragfix-comparison"


#: ``config.json`` fields that decide what a cell (sample, position) is: the data and the
#: content of every input file (``inputs``), the passages per prompt, the record range and the
#: prompt layout (distractors; a pipeline's corpus, its questions, needles or written questions,
#: retriever, chunking, embedder and framework). Runs are paired only when they agree on all of
#: them (a field absent from both agrees). The task form (``task``: ``qa``, ``qa-extractive``, a
#: repeated variant) is not among them: it is a treatment of the same cells, as a backend is
#: (the same data file read as another format cannot pair: its samples differ).
CELL_FIELDS = (
    "data",
    "inputs",
    "num_docs",
    "records",
    "distractor_pool",
    "corpus",
    "questions",
    "retriever",
    "chunk_size",
    "embedder",
    "needles",
    "questions_from",
    "framework",
)


#: fields holding file paths, compared by file name (runs made on another machine still pair;
#: their contents are compared by ``inputs``)
PATH_FIELDS = ("data", "distractor_pool", "corpus", "questions")


@dataclass
class Run:
    """A finished run folder read for a comparison.

    Attributes:
        name: its label in tables (the folder name; the path as given when names repeat).
        folder: the run folder.
        config: its ``config.json`` (``{}`` when it has none).
        summary: its ``summary.json``.
        curves: ``{curve label: {(sample_id, position): correct}}``, of the scored cells only
            (:func:`ragfix.eval.sweep.split_scored`: no sample with an unscored cell).
        continued: ``{curve label: answers that continue the context}``
            (:func:`ragfix.metrics.continues_context`), over the same cells.
        blank: ``{curve label: answers with no text but whitespace}`` (scored wrong: a model
            that answers nothing, or a prompt form that makes it stop at once), over the same
            cells.
        records: every cell the run reported (overflowed ones included), as stored, in the
            summary's order (what ``ragfix report --html`` lists).
        references: ``{curve label: {reference: {sample_id: correct}}}``: the run's scored
            reference cells (closed-book, oracle; :mod:`ragfix.eval.sweep`), empty for a run
            without them.
    """

    name: str
    folder: Path
    config: dict
    summary: dict
    curves: dict[str, Cells]
    continued: dict[str, int]
    blank: dict[str, int]
    records: list[dict]
    references: dict[str, dict[str, dict[str, bool]]] = field(default_factory=dict)


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
    reported = [stored[i] for i in ids]
    records, ref_records, _ = split_scored(reported)
    curves = cells_by_curve(records)
    continued, blank = dict.fromkeys(curves, 0), dict.fromkeys(curves, 0)
    for r in records:
        continued[curve_label(r)] += continues_context(r.get("answer", ""))
        blank[curve_label(r)] += not r.get("answer", "").strip()
    references = reference_cells(ref_records)
    run = Run(
        name or folder.name, folder, config, summary, curves, continued, blank, reported, references
    )
    if not run.curves:
        why = "; ".join(unscored_lines(summary)[1:])
        raise DataError(
            folder,
            None,
            None,
            "no scored cell in this run (nothing to compare)" + (f": {why}" if why else ""),
        )
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
    if name == "embedder" and value == DEFAULT_EMBEDDER:
        return None  # what a pipeline run made before the embedder was recorded used
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
    :func:`ragfix.connectors.records.parse_records`) as ``(start, stop)``; ``None``, ``""`` or
    ``"all"`` is every record ``(0, inf)``, and so is an open end.

    Raises:
        DataError: not a record range (names ``where`` and the field).
    """
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


def load_runs(paths: list[str | Path]) -> list[Run]:
    """:func:`load_run` of every path, each named by its folder (by the path as given where two
    folders have the same name).

    Raises:
        ConfigError: one folder given twice (a paired comparison of a run with itself).
        DataError: see :func:`load_run`.
    """
    folders = [Path(p) if Path(p).is_dir() else Path(p).parent for p in paths]
    seen: dict[Path, str | Path] = {}
    for p, f in zip(paths, folders, strict=True):
        if f.resolve() in seen:
            raise ConfigError(
                f"{p} is given twice (as {seen[f.resolve()]} too): give each run once"
            )
        seen[f.resolve()] = p
    names = [f.name for f in folders]
    return [
        load_run(p, n if names.count(n) == 1 else str(p)) for p, n in zip(paths, names, strict=True)
    ]


def compare_runs(
    paths: list[str | Path],
    *,
    plot: str | Path | None = None,
    title: str | None = None,
    resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> dict:
    """:func:`compare_loaded` of the run folders ``paths`` (:func:`load_runs`).

    Raises:
        DataError: a folder without a readable summary, or a malformed ``tuned_on`` /
            ``records``.
    """
    return compare_loaded(load_runs(paths), plot=plot, title=title, resamples=resamples, seed=seed)


def compare_loaded(
    runs: list[Run],
    *,
    plot: str | Path | None = None,
    title: str | None = None,
    resamples: int = N_RESAMPLES,
    seed: int = SEED,
) -> dict:
    """Compare runs: figures of merit of every curve, and paired comparisons where the cells
    are the same.

    Runs are grouped by :func:`config_differences` (a run joins the first group whose first run
    has the same cells); in each group every curve is paired with the baseline curve of the
    group's first run (its first curve; a reorder run's ``/none`` curve), unless one of the two
    runs tuned on the compared records (:func:`tuned_conflict`) or they share no
    cell. Every curve not paired gets a one-line note saying why. Where the baseline run has
    reference points, every curve of a run of the same model (and not tuned on the records)
    gets its worst position set against the baseline's oracle (``ceilings``,
    :func:`_to_ceiling`): what the model reads at best, the target of a correction.

    Args:
        runs: the runs (:func:`load_runs`); the first one's first curve is the baseline (its
            ``/none`` curve when it compares reorder strategies).
        plot: draw every curve into this PNG, one panel per group of runs with the same cells.
        title: the plot's title.
        resamples, seed: bootstrap settings (:mod:`ragfix.eval.merit`).

    Returns:
        The comparison (the JSON ``ragfix report --json`` writes): ``kind``, ``bootstrap``,
        ``alpha``, ``runs`` (name, path, config, x axis, every curve's
        :class:`~ragfix.eval.merit.CurveMerit` and, for a run with reference points, its
        ``references``), ``groups`` (run names), ``paired`` (``baseline`` and ``other`` labels
        plus a :class:`~ragfix.eval.merit.PairedMerit`), ``ceilings`` (``oracle`` and
        ``curve`` labels plus :func:`_to_ceiling`; only when there are any) and ``notes``.

    Raises:
        DataError: a malformed ``tuned_on`` in a run's configuration.
    """
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
    paired, ceilings = [], []
    for group in groups:
        base_run = group[0]
        base_curve = _baseline_curve(base_run)
        base_cells = base_run.curves[base_curve]
        base = _label(base_run, base_curve)
        oracle = base_run.references.get(base_curve, {}).get(ORACLE)
        for run in group:
            same_model = run.config.get("model") == base_run.config.get("model")
            tuned = tuned_conflict(run, base_run) or tuned_conflict(base_run, run)
            for curve, cells in run.curves.items() if oracle and same_model and not tuned else ():
                ceiling = _to_ceiling(oracle, cells)
                if ceiling is not None:
                    ceilings.append({"oracle": base, "curve": _label(run, curve), **ceiling})
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
                        same = _same_answers(base_run, base_curve, run, curve)
                        paired.append(
                            {
                                "baseline": base,
                                "other": other,
                                **merit.model_dump(),
                                "same_answers": same,
                            }
                        )
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
                "blank": r.blank,
                **_retrieval_weighted(r, resamples, seed),
                **({"references": reference_points(r.references)} if r.references else {}),
                **({"written_questions": w} if (w := r.summary.get("written_questions")) else {}),
            }
            for r in runs
        ],
        "groups": [[r.name for r in g] for g in groups],
        "paired": paired,
        **({"ceilings": ceilings} if ceilings else {}),
        "notes": notes,
    }


def _same_answers(a: Run, curve_a: str, b: Run, curve_b: str) -> int:
    """Cells of curve ``curve_a`` of ``a`` and ``curve_b`` of ``b`` (same sample and position)
    whose answers are the same text (surrounding whitespace aside): what two runs that should
    agree (another dtype, batch or engine) answered alike, beyond their labels."""

    def answers(run: Run, curve: str) -> dict[tuple[str, int], str]:
        return {
            (r["sample_id"], int(r["position"])): r.get("answer", "").strip()
            for r in run.records
            if curve_label(r) == curve and (r["sample_id"], int(r["position"])) in run.curves[curve]
        }

    mine, theirs = answers(a, curve_a), answers(b, curve_b)
    return sum(text == theirs.get(key) for key, text in mine.items())


def _to_ceiling(oracle: dict[str, bool], cells: Cells) -> dict | None:
    """A curve's worst position against an oracle, paired by sample, or ``None`` when they
    share no sample: ``worst_position`` (the lowest accuracy, the first of equals),
    ``positions`` (how many it was picked from), the samples both have (``n``), the oracle's
    and the position's accuracy on them, their ``difference`` (position - oracle), the
    discordant counts (``oracle_only``, ``position_only``), the exact McNemar ``p_raw`` and
    ``p``, its Bonferroni adjustment for the worst of ``positions`` (at most 1)."""
    by_pos: dict[int, dict[str, bool]] = {}
    for (sample, pos), ok in cells.items():
        by_pos.setdefault(pos, {})[sample] = ok
    worst = min(sorted(by_pos), key=lambda p: sum(by_pos[p].values()) / len(by_pos[p]))
    common = sorted(set(oracle) & set(by_pos[worst]))
    if not common:
        return None
    at = [by_pos[worst][s] for s in common]
    ref = [oracle[s] for s in common]
    oracle_only = sum(o and not a for o, a in zip(ref, at, strict=True))
    position_only = sum(a and not o for o, a in zip(ref, at, strict=True))
    n, raw = len(common), mcnemar_exact(oracle_only, position_only)
    return {
        "worst_position": worst,
        "positions": len(by_pos),
        "n": n,
        "oracle_accuracy": sum(ref) / n,
        "accuracy": sum(at) / n,
        "difference": (sum(at) - sum(ref)) / n,
        "oracle_only": oracle_only,
        "position_only": position_only,
        "p_raw": raw,
        "p": min(1.0, raw * len(by_pos)),
    }


def _baseline_curve(run: Run) -> str:
    """The curve the others are paired with: a reorder run's no-reordering curve
    (``<backend>/none``), else the run's first curve."""
    return next((c for c in run.curves if c.endswith("/none")), next(iter(run.curves)))


def _retrieval_weighted(run: Run, resamples: int, seed: int) -> dict:
    """``{"retrieval_weighted": {curve: RetrievalWeighted}}`` of a pipeline sweep's run (its
    records carry the gold chunk's natural rank), ``{}`` of any other run. ``questions`` of a
    natural-rank run is every question it asked (its summary's ``natural_rank_counts``), the
    ones whose gold chunk was not retrieved included, and such a run is marked
    ``natural_ranks`` (each question at one rank: its positions hold different questions)."""
    ranks = natural_ranks(run.records)
    if ranks is None:
        return {}
    # a natural-rank run has no cell of a question whose gold chunk was not retrieved: its
    # summary counts every question asked (``None``: not retrieved)
    counts = (
        run.summary.get("natural_rank_counts") if run.summary.get("ranks") == "natural" else None
    )
    out = {}
    for c, cells in run.curves.items():
        m = retrieval_weighted_merit(cells, ranks, resamples=resamples, seed=seed)
        if m is not None:
            if counts:
                m = m.model_copy(update={"questions": sum(counts.values())})
            out[c] = m.model_dump()
    return {"retrieval_weighted": out, **({"natural_ranks": True} if counts else {})}


def _differences(a: Run, b: Run) -> list[str]:
    missing = [r.name for r in (a, b) if not r.config]
    if missing:
        return [f"no {CONFIG_FILE} in {', '.join(missing)}"]
    return config_differences(a.config, b.config)


def _same_cells(a: Run, b: Run) -> bool:
    return a is b or not _differences(a, b)


def comparison_tables(comparison: dict, kind: str = "comparison") -> list[TableSpec]:
    """The tables of a comparison (:func:`compare_runs`) or of a ``summary.json`` wrapped as a
    one-run comparison (:func:`ragfix.eval.results.load_result`).

    Args:
        kind: ``curve`` (per-position table of every curve, after the references table when
            the runs have reference points), ``references`` (each curve's
            closed-book and oracle, and its worst position against the baseline's oracle: runs
            made with reference points), ``merit`` (figures of merit of every curve, after the
            references table when the runs have reference points), ``paired`` (per-position
            differences and McNemar p of every pair, then the notes on runs not paired),
            ``comparison`` (all of them).

    Raises:
        DataError: ``references``, ``merit`` or ``paired`` asked of a ``summary.json`` (they
            need the cells: use ``ragfix report RUN --json FILE``).
    """
    if kind in ("references", "merit", "paired") and comparison.get("kind") != COMPARISON_KIND:
        raise DataError(
            comparison.get("source"),
            None,
            None,
            f"{kind} tables need a comparison file (`ragfix report RUN... --json FILE`)",
        )
    tables: list[TableSpec] = []
    if kind in ("curve", "references", "merit", "comparison") and any(
        run.get("references") for run in comparison["runs"]
    ):
        tables.append(_references_table(comparison))
    if kind in ("curve", "comparison"):
        for run in comparison["runs"]:
            several = len(comparison["runs"]) > 1 or comparison.get("kind") == COMPARISON_KIND
            for c, curve in run["curves"].items():
                tables.append(
                    curve_table(f"{run['name']}:{c}" if several else c, curve, run["x_axis"])
                )
    if kind in ("merit", "comparison"):
        tables.append(_merit_table(comparison))
        if any(run.get("retrieval_weighted") for run in comparison["runs"]):
            tables.append(_retrieval_table(comparison))
    if kind in ("paired", "comparison"):
        tables += [_paired_table(p, comparison) for p in comparison["paired"]]
        if comparison["notes"]:
            tables.append(TableSpec("not paired", lines=list(comparison["notes"])))
    return tables


def _references_table(comparison: dict) -> TableSpec:
    """:func:`~ragfix.eval.sweep_summary.references_table` of every curve of the comparison,
    with its ceiling where it has one."""
    references = {
        f"{run['name']}:{c}": run.get("references", {}).get(c, {})
        for run in comparison["runs"]
        for c in run["curves"]
    }
    ceilings = {c["curve"]: c for c in comparison.get("ceilings", [])}
    return references_table(references, ceilings)


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
                    fmt_num(m["mean"]),
                    fmt_ci(m["mean_ci"]),
                    f"{fmt_num(m['worst'])} @ {m['worst_position']}",
                    fmt_ci(m["worst_ci"]),
                    f"{fmt_num(m['best'])} @ {m['best_position']}",
                    fmt_num(m["gap"]),
                    fmt_ci(m["gap_ci"]),
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
    qa = task_names("qa")  # a repeated variant (NAME:repeat-MODE) reads its task's records
    tasks = {
        run_task(run.get("config", {})).partition(REPEAT_SUFFIX)[0] for run in comparison["runs"]
    }
    if counts and tasks.intersection(qa):
        lines.append(
            "Answers that continue the document list instead of answering "
            f"(`Document [...`): {'; '.join(counts)}."
        )
    blank = [
        f"{run['name']}:{c} {run['blank'][c]} of {m['cells']}"
        for run in comparison["runs"]
        if any(run.get("blank", {}).values())  # files written before the count lack it
        for c, m in run["curves"].items()
    ]
    if blank:
        lines.append(f"Blank answers (no text; scored wrong): {'; '.join(blank)}.")
    for run in comparison["runs"]:
        w = run.get("written_questions")
        if w:
            drops = ", ".join(f"{k} {v}" for k, v in w["dropped"].items())
            lines.append(
                f"{run['name']}: questions written by {w['model']}, {w['kept']} of "
                f"{w['asked']} kept; dropped: {drops}."
            )
    return TableSpec("figures of merit", headers, rows, lines)


def _retrieval_table(comparison: dict) -> TableSpec:
    rows = []
    for run in comparison["runs"]:
        for c, m in run.get("retrieval_weighted", {}).items():
            ci = fmt_ci(m["ci"]) if m["ci"] else "-"
            ranks = ", ".join(f"{r}: {n}" for r, n in m["ranks"].items())
            rows.append([f"{run['name']}:{c}", f"{m['retrieved']} of {m['questions']}", ranks])
            rows[-1] += [fmt_num(m["accuracy"]), ci]
    line = (
        "Each rank's accuracy weighted by how often the retriever itself ranked the gold chunk "
        "there (questions whose gold chunk it missed left out): what a user of this retriever "
        "sees on average. 95% interval: percentile bootstrap over questions."
    )
    headers = ["curve", "gold retrieved", "at rank: questions", "retrieval-weighted", "95% CI"]
    return TableSpec("retrieval-weighted accuracy", headers, rows, [line])


def _paired_table(pair: dict, comparison: dict) -> TableSpec:
    base, other = pair["baseline"], pair["other"]
    rows = [
        [
            str(p["position"]),
            str(p["n"]),
            fmt_num(p["baseline"]),
            fmt_num(p["other"]),
            fmt_signed(p["diff"]),
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
        f"{fmt_signed(pair['mean_diff'])} {fmt_ci(pair['mean_diff_ci'], True)}, gap difference "
        f"{fmt_signed(pair['gap_diff'])} {fmt_ci(pair['gap_diff_ci'], True)}, right only in "
        f"{other} {pair['only_other']}, only in {base} {pair['only_baseline']}, McNemar p = "
        f"{pair['p_value']:.3g} ({significance(pair['p_value'])} at {comparison['alpha']})"
    )
    if "same_answers" in pair:  # not in result files written without the count
        line += f"; the same answer text in {pair['same_answers']} of {pair['cells']} cells"
    return TableSpec(
        f"{other} paired with {base} (same samples and positions)", headers, rows, [line]
    )


def write_comparison(path: str | Path, comparison: dict) -> None:
    """Write a comparison (:func:`compare_runs`) as indented JSON, atomically."""
    atomic_write_json(path, comparison)
