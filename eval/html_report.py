"""``ragfix report RUNS... --html FILE``: one self-contained HTML page to browse runs by.

The page holds everything it shows (nothing is fetched when it is viewed): the curves with their
95% bands (the plot of :func:`ragfix.eval.plot.curve_figure`, inlined as SVG), the tables of
``ragfix report`` (:func:`ragfix.eval.compare.comparison_tables`, the flagged cells of
:func:`ragfix.eval.sweep_summary.flags_table`, a judge run's
:func:`ragfix.judge.report.judge_tables`), and every cell: per position, the list of cells of the
runs that share them (side by side), each opening to the prompt its model read with the gold
passage highlighted, its answer, the gold answers and the score; filters keep the cells right in
one run only, or those with a flag.

Where the prompt comes from: a sweep's or a pipeline sweep's record keeps it
(:attr:`ragfix.types.SweepRecord.prompt`); a run made with ``--no-log-prompts`` has none and the
page says so. A position sweep made before records kept prompts has its prompts rebuilt from its
data file (:func:`rebuild_prompts`: the sweep's own cells and prompt builder, when the file's
content fingerprint is still the one in its ``config.json`` and its backend reads the task prompt
as it is), each labelled as rebuilt; a pipeline sweep's cannot be (its records keep only the
prompt's SHA-1). A judge run's prompts are rebuilt from its pair file
(:func:`ragfix.judge.judge.pair_prompts`; on the same fingerprint check), both orders of a pair
side by side. Where prompts cannot be rebuilt, the page says why in one line.

The static parts are rendered by a Jinja2 template (autoescaped); the cells are a JSON payload
the page's script lays out on demand, always as text (never parsed as HTML). Prompt texts are
stored once per distinct piece (the passages of a sample recur at every position), so the file
grows with the distinct text of the run rather than with its cells times their prompts.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

from ragfix.errors import DataError
from ragfix.eval.compare import Run, comparison_tables
from ragfix.eval.judge_run import JUDGMENTS_FILE
from ragfix.eval.judge_run import PLOT_FILE as JUDGE_PLOT
from ragfix.eval.plot import curve_figure
from ragfix.eval.sweep import Cell, SweepConfig, plan_cells, stored_prompt, summary_counts
from ragfix.eval.sweep_summary import (
    SUMMARY_FILE,
    curve_label,
    flags_table,
    on_curves,
    read_summary,
)
from ragfix.io import atomic_write_text
from ragfix.judge.report import JUDGE_KIND, judge_tables
from ragfix.prompts import NO_CHAT_TEMPLATE
from ragfix.tables import TableSpec
from ragfix.types import OVERFLOW

#: pseudo-flags of a pipeline cell, from its ``extra`` (the filter lists them with the flags)
PIPELINE_FLAGS = ("gold_added", "context_cut")

#: what a cell of a run made before records kept prompts says when its prompt is not rebuilt
NOT_KEPT = "prompt not stored: the run was made before ragfix kept prompts"

#: what a cell of such a run says when its backend rearranges the passages before reading
REARRANGED = (
    "prompt not stored; this backend rearranges the passages before reading, so it cannot be "
    "rebuilt without the model"
)


def is_judge_run(path: str | Path) -> bool:
    """Whether ``path`` (a run folder or a file in one) is a judge run: its ``summary.json`` is a
    ``ragfix-judge`` result file. A folder without a readable summary is not (the sweep's
    loader says why)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    try:
        return read_summary(folder).get("kind") == JUDGE_KIND
    except DataError:
        return False


@dataclass
class JudgeRun:
    """A judge run folder read for the page.

    Attributes:
        name: its label (the folder name).
        folder: the run folder.
        summary: its ``summary.json`` (a ``ragfix-judge`` result file).
        records: its judgments (``judgments.jsonl``), of the pairs its summary covers.
        pairs: ``{pair_id: JudgePair}`` rebuilt from the pair file, ``{}`` when it cannot be.
        missing: why the prompts cannot be shown (``""`` when they can).
    """

    name: str
    folder: Path
    summary: dict
    records: list[dict] = field(default_factory=list)
    pairs: dict = field(default_factory=dict)
    missing: str = ""

    @property
    def config(self) -> dict:
        """The run's configuration (``{}`` for other judges' verdicts)."""
        return self.summary.get("config") or {}


def load_judge_run(path: str | Path) -> JudgeRun:
    """Read a judge run folder: its summary, its judgments and, when the pair file is still
    there with the content the run read (its fingerprint in ``config.json``), its pairs.

    Raises:
        DataError: no readable ``summary.json``, or not a judge run.
    """
    from ragfix.connectors.jsonl import SkipCounter
    from ragfix.connectors.pairwise import load_pairs
    from ragfix.eval.run import folder_store
    from ragfix.fingerprint import content_fingerprint

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    summary = read_summary(folder)
    if summary.get("kind") != JUDGE_KIND:
        raise DataError(folder / SUMMARY_FILE, None, "kind", "not a judge run's summary")
    run = JudgeRun(folder.name, folder, summary)
    config = run.config
    if not config:
        run.missing = "verdicts of other judges: the run judged no pairs itself"
        return run
    stored = folder_store(folder, JUDGMENTS_FILE, "pair_id").load()
    data = Path(config["data"])
    if not data.exists():
        run.missing = f"the pair file {data} is not there any more"
    elif content_fingerprint(data) != config.get("inputs", {}).get("data"):
        run.missing = f"the pair file {data} has changed since the run"
    else:
        models = tuple(config.get("mtbench_models") or ("gpt-4", "gpt-3.5-turbo"))
        wrong = config.get("kv_wrong", "context")
        pairs = load_pairs(data, summary.get("limit"), True, SkipCounter(), models, kv_wrong=wrong)
        run.pairs = {p.pair_id: p for p in pairs}
    ids = list(run.pairs) if run.pairs else list(stored)
    run.records = [stored[i] for i in ids if i in stored]
    return run


@dataclass(frozen=True)
class RebuiltPrompts:
    """The prompts of a position sweep made before records kept them, as :func:`rebuild_prompts`
    rebuilt them for the page.

    Attributes:
        cells: ``{cell id: Cell}`` of the run's data file, planned by the sweep's own
            :func:`~ragfix.eval.sweep.plan_cells` (empty when they cannot be rebuilt).
        label: what the page says with each rebuilt prompt: ``"rebuilt from FILE, fingerprint
            checked"``.
        missing: why they cannot be rebuilt, the one line a cell and the page's notes show
            (``""`` when they are).
    """

    cells: dict = field(default_factory=dict)
    label: str = ""
    missing: str = ""


def rebuild_prompts(run: Run) -> RebuiltPrompts | None:
    """The prompts of ``run``'s cells rebuilt exactly as its sweep built them, for a position
    sweep made before records kept prompts (``config.json`` without ``log_prompts``; None for
    any other run: its records keep their prompts, it was made with ``--no-log-prompts``, or it
    is a pipeline sweep, whose records keep only the prompt's SHA-1).

    They are rebuilt only when they are what the model read: when the run's backend reads the
    task prompt as it is (its class, :func:`ragfix.backends.backend_class`, does not override
    :meth:`~ragfix.backends.Backend.read_prompt`: ``attention-sort`` rearranges the passages
    with the model) and the data file and distractor pool have the content fingerprints of its
    ``config.json`` (:func:`ragfix.eval.run.input_fingerprints`). The samples are read as the
    sweep read them (:func:`ragfix.connectors.litm.load_samples`, the run's record range; every
    sample of it, malformed records skipped, since ``--limit`` is not recorded) and planned into
    cells by the sweep (:func:`~ragfix.eval.sweep.plan_cells`, whose cell ids hash the run's
    settings), so a record's prompt is the one of the cell with its cell id
    (:func:`~ragfix.eval.sweep.stored_prompt`). Otherwise ``missing`` says why.
    """
    from pydantic import ValidationError

    from ragfix.backends import Backend, backend_class
    from ragfix.connectors.litm import load_samples
    from ragfix.errors import ConfigError
    from ragfix.eval.run import input_fingerprints

    config = run.config
    if config.get("run") != "sweep" or "log_prompts" in config:
        return None

    def cannot(why: str) -> RebuiltPrompts:
        return RebuiltPrompts(missing=f"{NOT_KEPT}, and cannot be rebuilt: {why}")

    try:
        cfg = SweepConfig.model_validate(config)
        cls = backend_class(cfg.backend, cfg.model)
    except ValidationError as e:
        return cannot(f"its config.json is not a sweep's ({e.errors()[0]['msg']})")
    except ConfigError as e:
        return cannot(str(e))
    if cls.read_prompt is not Backend.read_prompt:
        return RebuiltPrompts(missing=REARRANGED)
    try:
        now = input_fingerprints(data=cfg.data, distractor_pool=cfg.distractor_pool)
    except DataError as e:
        return cannot(f"{e.path} is not there any more")
    files = {"data": f"data file {cfg.data}", "distractor_pool": f"pool {cfg.distractor_pool}"}
    for role, fingerprint in now.items():
        if cfg.inputs.get(role) != fingerprint:
            return cannot(f"the {files[role]} has changed since the run (fingerprint check)")
    try:
        samples = load_samples(
            cfg.data, cfg.num_docs, None, cfg.distractor_pool, True, records=cfg.records
        )
    except DataError as e:
        return cannot(str(e))
    positions = sorted({int(r["position"]) for r in on_curves(run.records)})
    cells = {c.cell_id: c for c in plan_cells(cfg, samples, positions)}
    return RebuiltPrompts(cells, f"rebuilt from {Path(cfg.data).name}, fingerprint checked")


class _Strings:
    """Text pieces stored once each (the payload's ``strings``), referred to by index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def ref(self, text: str) -> int:
        return self.index.setdefault(text, len(self.index))

    def segments(self, text: str, spans, gold: int | None) -> list[list[int]]:
        """``text`` cut at the passage ``spans``: ``[[piece, kind], ...]``, kind 0 for text
        between passages, 1 for a passage, 2 for the gold passage."""
        out, at = [], 0
        for i, (start, end) in enumerate(spans):
            if start > at:
                out.append([self.ref(text[at:start]), 0])
            out.append([self.ref(text[start:end]), 2 if i == gold else 1])
            at = end
        if at < len(text):
            out.append([self.ref(text[at:]), 0])
        return out


def _missing_prompt(record: dict, config: dict, rebuilt: RebuiltPrompts | None) -> str:
    """Why a sweep record has no prompt, stored or rebuilt (``rebuilt``: the run's
    :func:`rebuild_prompts`)."""
    if OVERFLOW in record.get("flags", ()) and "gold_added" in record.get("extra", {}):
        return "not run: the retrieved chunks do not fit the window, no prompt was sent"
    if rebuilt is not None:
        return rebuilt.missing or f"{NOT_KEPT}, and its cell is not among those of its data file"
    if "log_prompts" not in config:
        return NOT_KEPT
    return "prompt not stored: the run was made with --no-log-prompts"


def _sweep_cell(
    record: dict,
    scored: bool,
    config: dict,
    rebuilt: RebuiltPrompts | None,
    planned: Cell | None,
    strings: _Strings,
) -> dict:
    """The payload of one sweep cell: its prompt as stored or, in a run made before records
    kept prompts, rebuilt from ``planned`` (its cell in ``rebuilt``; the prompt then labelled
    so), else why it has none."""
    extra = record.get("extra", {})
    flags = [*record.get("flags", []), *(f for f in PIPELINE_FLAGS if extra.get(f))]
    prompt = record.get("prompt")
    if prompt is None and planned is not None:
        prompt = stored_prompt(planned, None, reads_chat(config)).model_dump()
    facts = [
        ["prompt position", record.get("prompt_position")],
        ["prompt tokens", record.get("prompt_tokens")],
        ["new tokens", record.get("new_tokens")],
        ["seconds", record.get("seconds")],
        *([["natural rank", extra["natural_rank"]]] if "natural_rank" in extra else []),
        *([["LLM calls", extra["llm_calls"]]] if "llm_calls" in extra else []),
        ["cell id", record.get("cell_id")],
    ]
    cell = {
        "answer": record.get("answer", ""),
        "ok": bool(record.get("correct")),
        "scored": scored,
        "flags": flags,
        "facts": [f for f in facts if f[1] is not None],
    }
    if prompt:
        cell["prompt"] = strings.segments(prompt["text"], prompt["passages"], prompt.get("gold"))
        cell["prefix"] = prompt.get("assistant_prefix", "")
        if record.get("prompt") is None:
            cell["rebuilt"] = rebuilt.label
    else:
        cell["missing"] = _missing_prompt(record, config, rebuilt)
    return cell


def _sweep_group(
    group: list[Run],
    comparison: dict,
    rebuilt: dict[str, RebuiltPrompts | None],
    strings: _Strings,
) -> dict:
    """The payload of a group of runs with the same cells: its columns (``run:curve``, as the
    tables label them), one row per (sample, position) with each column's cell, and the
    baseline curve's worst position (shown first). ``rebuilt``: each run's
    :func:`rebuild_prompts` by name (a rebuilt cell's sample also gives its row the question and
    gold answers its record may lack). A sweep's reference cells (closed-book, oracle) are in
    the tables, not among the rows: they have no position."""
    columns: list[str] = []
    rows: dict[tuple[str, int], dict] = {}
    for run in group:
        scored_ids = {r["cell_id"] for r in summary_counts(run.records)[0]}
        prompts = rebuilt[run.name]
        records = on_curves(run.records)
        labels = sorted({curve_label(r) for r in records})
        for label in labels:
            columns.append(f"{run.name}:{label}")
        for r in records:
            key = (r["sample_id"], int(r["position"]))
            row = rows.setdefault(
                key, {"key": key[0], "pos": key[1], "q": None, "gold": None, "cells": {}}
            )
            planned = prompts.cells.get(r["cell_id"]) if prompts is not None else None
            sample = planned.sample if planned is not None else None
            row["q"] = row["q"] or r.get("question") or (sample and sample.question)
            row["gold"] = row["gold"] or r.get("gold_answers") or (sample and sample.answers)
            col = f"{run.name}:{curve_label(r)}"
            scored = r["cell_id"] in scored_ids
            row["cells"][col] = _sweep_cell(r, scored, run.config, prompts, planned, strings)
    for row in rows.values():
        row["cells"] = [row["cells"].get(c) for c in columns]
    base = next(r for r in comparison["runs"] if r["name"] == group[0].name)
    first = next(iter(base["curves"].values()))
    ordered = sorted(rows.values(), key=lambda r: (r["pos"], r["key"]))
    return {
        "kind": "sweep",
        "title": ", ".join(r.name for r in group),
        "x_axis": base["x_axis"],
        "columns": columns,
        "positions": sorted({r["pos"] for r in ordered}),
        "worst": first["worst_position"],
        "rows": ordered,
    }


def reads_chat(config: dict) -> bool:
    """Whether the run of ``config`` (a ``config.json``) read its task prompts in a chat
    template: not when its identity records :data:`~ragfix.prompts.NO_CHAT_TEMPLATE` (a base
    model, which read their completion form, or a folder's older record of it)."""
    template = str((config.get("identity") or {}).get("chat_template"))
    return not template.startswith(NO_CHAT_TEMPLATE.partition(":")[0] + ":")


def _order(name: str, order: dict, prompt, chat: bool, strings: _Strings) -> dict:
    """The payload of one order of a judged pair (``chat``: :func:`reads_chat`): ``ll`` holds the
    summed log-probabilities of the answers in slots A and B as the reply (the ``answer`` style;
    ``[None, None]`` for a generated verdict)."""
    out = {
        "name": name,
        "reply": order.get("raw", ""),
        "verdict": order.get("slot_verdict"),
        "p": [order.get("p_a"), order.get("p_b")],
        "ll": [order.get("ll_a"), order.get("ll_b")],
    }
    if prompt is not None:
        out["prompt"] = strings.segments(prompt.user, prompt.passages, None)
        out["prefix"] = prompt.answer_prefix(chat)
    return out


def _judge_group(runs: list[JudgeRun], strings: _Strings) -> dict:
    """The payload of judge runs on the same pair file: one column per run, one row per pair,
    each cell both orders side by side; a cell is right when its two verdicts agree."""
    from ragfix.judge.judge import pair_prompts

    rows: dict[str, dict] = {}
    for k, run in enumerate(runs):
        style, swap = run.config.get("style", "verdict"), run.config.get("swap", "relabel")
        labels = run.config.get("labels", "slot")
        chat = reads_chat(run.config)
        for rec in run.records:
            pair = run.pairs.get(rec["pair_id"])
            row = rows.setdefault(
                rec["pair_id"],
                {"key": rec["pair_id"], "pos": None, "q": None, "gold": None, "cells": {}},
            )
            prompts = (
                pair_prompts(pair, style, swap, labels=labels) if pair is not None else (None, None)
            )
            if pair is not None:
                row["q"] = pair.question
                row["gold"] = [f"human label: {pair.label}"] if pair.label else None
            swapped = "answers moved" if swap == "move" else "answers exchanged"
            cell = {
                "answer": f"{rec['verdict_original']} / {rec['verdict_swapped']}",
                "ok": bool(rec.get("consistent")),
                "scored": OVERFLOW not in rec.get("flags", ()),
                "flags": list(rec.get("flags", [])),
                "orders": [
                    _order("original order", rec["original"], prompts[0], chat, strings),
                    _order(f"swapped order ({swapped})", rec["swapped"], prompts[1], chat, strings),
                ],
                "facts": [
                    ["swap-aggregated verdict", rec.get("swap_verdict")],
                    ["logit verdict", rec.get("logit_verdict")],
                    ["label", rec.get("label")],
                    ["pair id", rec["pair_id"]],
                ],
            }
            if pair is None:
                cell["missing"] = f"prompt not shown: {run.missing or 'pair not in the file'}"
            row["cells"][k] = cell
    for row in rows.values():
        row["cells"] = [row["cells"].get(k) for k in range(len(runs))]
    return {
        "kind": "judge",
        "title": ", ".join(r.name for r in runs),
        "x_axis": "pair",
        "columns": [r.name for r in runs],
        "positions": [],
        "worst": None,
        "rows": list(rows.values()),
    }


def _prompts_kept(config: dict, rebuilt: RebuiltPrompts | None) -> str:
    """Where a sweep run's prompts come from, in words (``rebuilt``: its
    :func:`rebuild_prompts`)."""
    if rebuilt is not None:
        return rebuilt.missing or rebuilt.label
    if "log_prompts" not in config:
        return "not stored (made before ragfix kept prompts)"
    return "stored" if config["log_prompts"] else "not stored (--no-log-prompts)"


def _source_row(name: str, folder: Path, config: dict, prompts: str) -> list[str]:
    """A row of the page's table of runs: name, folder, model, backend, data file (a
    pipeline's questions and corpus), passages per prompt, and where the prompts come from."""
    files = [config[k] for k in ("data", "questions", "corpus") if config.get(k)]
    return [
        name,
        str(folder),
        str(config.get("model", "")),
        str(config.get("backend", "")),
        " + ".join(Path(f).name for f in files),
        str(config.get("num_docs", "")),
        prompts,
    ]


def _json_for_script(payload: dict) -> str:
    """``payload`` as JSON that can sit inside a ``<script>`` element: no ``<``, ``>`` or ``&``
    (escaped as ``\\u003c`` ...), so no text of a prompt can close the element."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _svg_uri(data: bytes) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(data).decode()


def _png_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def render_report(
    runs: list[Run],
    comparison: dict | None,
    judges: list[JudgeRun],
    title: str | None = None,
) -> str:
    """The page (HTML text) of sweep runs and judge runs.

    Args:
        runs: the sweep and pipeline runs (:func:`ragfix.eval.compare.load_runs`).
        comparison: their comparison (:func:`ragfix.eval.compare.compare_loaded`); None when
            there are no such runs.
        judges: the judge runs (:func:`load_judge_run`).
        title: the page's and the plot's title.
    """
    import jinja2
    from markupsafe import Markup

    strings = _Strings()
    groups, sections = [], []
    rebuilt = {r.name: rebuild_prompts(r) for r in runs}
    if comparison is not None:
        by_name = {r.name: r for r in runs}
        for names in comparison["groups"]:
            group = [by_name[n] for n in names]
            groups.append(_sweep_group(group, comparison, rebuilt, strings))
        figure = curve_figure(
            [(r.name, r.summary) for r in runs], title, comparison["groups"], fmt="svg"
        )
        tables = comparison_tables(comparison)
        tables += [t for r in runs if (t := flags_table(r.summary)) is not None]
        notes = [f"{n}: {p.missing}" for n, p in rebuilt.items() if p is not None and p.missing]
        tables += [TableSpec("prompts", lines=notes)] if notes else []
        sections.append({"title": "Sweeps", "figure": _svg_uri(figure), "tables": tables})
    by_data: dict[str, list[JudgeRun]] = {}
    for j in judges:
        by_data.setdefault(j.config.get("inputs", {}).get("data", j.name), []).append(j)
        plot = j.folder / JUDGE_PLOT
        notes = [TableSpec("prompts", lines=[f"{j.name}: {j.missing}"])] if j.missing else []
        sections.append(
            {
                "title": f"Judge run {j.name}",
                "figure": _png_uri(plot) if plot.exists() else None,
                "tables": judge_tables(j.summary) + notes,
            }
        )
    groups += [_judge_group(js, strings) for js in by_data.values() if any(j.records for j in js)]
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ragfix.eval", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    payload = {"strings": list(strings.index), "groups": groups}
    sources = [
        _source_row(r.name, r.folder, r.config, _prompts_kept(r.config, rebuilt[r.name]))
        for r in runs
    ]
    sources += [
        _source_row(j.name, j.folder, j.config, j.missing or "rebuilt from the pair file")
        for j in judges
    ]
    return env.get_template("report.html").render(
        title=title or "ragfix report",
        source_headers=["run", "folder", "model", "backend", "data", "passages", "prompts"],
        sources=sources,
        sections=sections,
        payload=Markup(_json_for_script(payload)),
    )


def write_html_report(
    path: str | Path,
    runs: list[Run],
    comparison: dict | None,
    judges: list[JudgeRun],
    title: str | None = None,
) -> Path:
    """Write :func:`render_report` to ``path`` (atomically); returns the path."""
    path = Path(path)
    atomic_write_text(path, render_report(runs, comparison, judges, title))
    return path


__all__ = [
    "JudgeRun",
    "RebuiltPrompts",
    "is_judge_run",
    "load_judge_run",
    "rebuild_prompts",
    "render_report",
    "write_html_report",
]
