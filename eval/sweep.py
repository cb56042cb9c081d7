"""The position sweep: every sample with its gold passage at every requested position.

A cell is (sample, gold position or reference point, task, backend, options); its id is a hash
of those, so a rerun with
the same ``--out`` skips finished cells (resume after Ctrl-C or a crash) and shards written by
several processes merge by cell id. Results are appended one JSON line per cell, fsynced.

Speed: the cells of one sample share their prompt up to the gold passage. With
``prefix_reuse`` (where the backend supports it) the cells of a sample run from the last position
to the first, and each one reuses the KV cache of the previous one cropped to their common token
prefix (``Backend.generate(..., prefix_reuse=True)``), prefilling only the rest: each distinct
prefix of the sample's token trie is computed once. With ``batch_size > 1`` (the default on a GPU)
up to ``batch_size`` cells of a sample are prefilled that way and then decoded in one batch.

Work the model cannot really do is never run: a cell whose prompt plus answer budget is longer
than the backend's ``context_window`` (``Backend.encode``) is stored with the flag ``overflow``
and no answer, instead of being truncated by the model (which would delete the gold passage at
one end and fake a curve). Such a sample is left out of the accuracy at *every* position
(:func:`summary_counts`), so each position's accuracy is over the same questions; the overflow
cells are counted per position in ``summary.json`` (``flags``) and in the printed table
(:func:`ragfix.eval.sweep_summary.print_flags`). A remote model's answers that are not a
measurement are treated the same way (:data:`~ragfix.types.UNSCORED`): ``empty_answer`` (the
server gave no text; its reason is kept and counted in the summary's ``empty_answer_reasons``)
and ``prompt_cut`` (the server cut the prompt). Gold answers that make the metric loose
(:func:`ragfix.metrics.degenerate_gold`) are scored, flagged ``degenerate_gold`` and counted the
same way.

Reference points: with ``references`` (the default for QA tasks) every sample also gets two
cells that place no gold passage among distractors: ``closed-book`` (the task's prompt without
passages: what the model knows without reading) and ``oracle`` (the gold passage alone: what it
can read). They are stored with ``reference`` set and ``position`` -1 (:data:`REFERENCE_POSITION`),
never enter a curve, and are summarised per curve in ``summary.json``'s ``references``
(:func:`summary_counts`), over the same samples as the curve: a reader sees whether the model
reads the context at all before reading its position curve.

Ctrl-C keeps every answer that had arrived: a backend that stops its requests in flight hands
them back (:class:`~ragfix.errors.Interrupted`) and :func:`run_cells` stores them before it
stops.

The orchestration (reading the data, resuming, sharding, the report) is
:func:`ragfix.eval.run_sweep`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from ragfix.backends.base import Backend, Fit, Prompt
from ragfix.connectors.records import RecordRange
from ragfix.errors import ConfigError, Interrupted
from ragfix.eval.run import RunConfig, RunFolder, folder_store
from ragfix.eval.sweep_summary import (
    CLOSED_BOOK,
    ORACLE,
    PLOT_FILE,
    REFERENCES,
    RESULTS_FILE,
    SUMMARY_FILE,
    curve_label,
    flag_order,
    on_curves,
)
from ragfix.io import JsonlStore
from ragfix.metrics import cell_flags, wilson_interval
from ragfix.tasks import score_answer, task_prompt
from ragfix.types import (
    EMPTY_ANSWER,
    OVERFLOW,
    UNSCORED,
    Generation,
    Passage,
    QASample,
    StoredPrompt,
    SweepRecord,
    generation_extra,
)

#: the ``position`` of a reference cell (it places no gold passage among distractors)
REFERENCE_POSITION = -1

#: the task fingerprints (:meth:`ragfix.tasks.Task.fingerprint`) of the two tasks that existed
#: before configurations recorded it: what a ``config.json`` without ``task_form`` stands for
LEGACY_TASK_FORMS = {"qa": "71b58d987828e304", "kv": "8b1c45cbc3ec2b89"}


class SweepConfig(RunConfig):
    """What makes the results of one output folder comparable (checked on every rerun, finished
    folders included: :class:`~ragfix.eval.run.RunFolder`).

    Frozen: its request fields are hashed into the cell ids. ``limit`` and ``positions`` are not
    part of it: a rerun may add samples or positions. Validated when built: an unknown field,
    ``num_docs < 1`` or a malformed record range is refused (pydantic ``ValidationError`` naming
    the value).

    Attributes:
        data: the data file (resolved path).
        task: the task (``qa``, ``qa-extractive``, ``kv``, ...: :func:`ragfix.tasks.task_names`).
        task_form: the task's :meth:`~ragfix.tasks.Task.fingerprint` (its rendered prompts): a
            rerun under an edited task is refused. A ``config.json`` written before it was
            recorded stands for its task as it was then (:data:`LEGACY_TASK_FORMS`); ``None``
            only in a configuration built to name cells, never in a run's.
        num_docs: passages per prompt.
        model: the model name.
        backend: the backend name.
        backend_options: the options as the user gave them (plus ``adapter`` when one is given).
        distractor_pool: the file distractors were drawn from, or None.
        records: the record range of the data file (``"0:200"``, see
            :func:`~ragfix.connectors.records.parse_records`),
            or None for the whole file; a rerun with another range is refused.
        log_prompts: whether each record keeps the prompt its model read
            (:attr:`~ragfix.types.SweepRecord.prompt`); not part of the cell ids, but a rerun
            with the other setting is refused like any other (a folder's cells either all keep
            their prompts or none do). A ``config.json`` written before the setting existed
            reads as False (:attr:`~ragfix.eval.run.RunConfig.ABSENT`): its records have none.
        identity, inputs: what the run ran on (:class:`~ragfix.eval.run.RunConfig`); ``inputs``
            has ``data`` and, with a pool, ``distractor_pool``.
    """

    run: Literal["sweep"] = "sweep"
    data: str
    task: str
    task_form: str | None = None
    num_docs: int
    model: str
    backend: str
    backend_options: dict = Field(default_factory=dict)
    distractor_pool: str | None = None
    records: RecordRange = None
    log_prompts: bool = True
    ABSENT: ClassVar[dict] = {"log_prompts": False}

    def absent(self, stored: dict) -> dict:
        """:attr:`ABSENT`, with ``task_form`` the fingerprint the stored task had before
        configurations recorded it (:data:`LEGACY_TASK_FORMS`)."""
        legacy = LEGACY_TASK_FORMS.get(stored.get("task"))
        return {**self.ABSENT, **({"task_form": legacy} if legacy else {})}

    @field_validator("num_docs")
    @classmethod
    def _at_least_one(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"num_docs {v} < 1: a prompt needs at least the gold passage")
        return v


@dataclass(frozen=True)
class Cell:
    """One unit of the sweep: a sample with its gold passage at ``position``, or one of its
    reference points (``reference``: :data:`CLOSED_BOOK` or :data:`ORACLE`, ``position``
    :data:`REFERENCE_POSITION`)."""

    cell_id: str
    sample: QASample
    position: int
    reference: str | None = None

    def passages(self) -> list[Passage]:
        """The passages the cell's prompt holds, in prompt order: none (closed-book), the gold
        alone (oracle), or the sample's with the gold at :attr:`position`."""
        if self.reference == CLOSED_BOOK:
            return []
        if self.reference == ORACLE:
            return [self.sample.gold]
        return self.sample.passages_with_gold_at(self.position)

    @property
    def gold_index(self) -> int | None:
        """Where the gold passage is among :meth:`passages` (``None``: closed-book)."""
        if self.reference == CLOSED_BOOK:
            return None
        return 0 if self.reference == ORACLE else self.position


def parse_positions(spec: str, num_docs: int) -> list[int]:
    """``"all"``, ``"first,middle,last"`` (any of the three words), or ``"0,4,9"``.

    ``middle`` is ``(num_docs - 1) // 2``.

    Raises:
        ConfigError: an unknown word or a position outside ``0 .. num_docs - 1``.
    """
    if spec.strip() == "all":
        return list(range(num_docs))
    named = {"first": 0, "middle": (num_docs - 1) // 2, "last": num_docs - 1}
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if part in named:
            pos = named[part]
        else:
            try:
                pos = int(part)
            except ValueError:
                raise ConfigError(
                    f"--positions: {part!r} is not 'all', first/middle/last or an integer"
                ) from None
        if not 0 <= pos < num_docs:
            raise ConfigError(
                f"--positions: {pos} is out of range 0..{num_docs - 1} for --num-docs {num_docs}"
            )
        if pos not in out:
            out.append(pos)
    return out


def cell_id(
    config: SweepConfig, sample_id: str, position: int, reference: str | None = None
) -> str:
    """Deterministic 16-hex id of a cell (of a reference point when ``reference`` is given)."""
    key = json.dumps(
        [
            sample_id,
            position if reference is None else reference,
            config.num_docs,
            config.task,
            config.model,
            config.backend,
            config.backend_options,
        ],
        sort_keys=True,
    )
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def plan_cells(
    config: SweepConfig,
    samples: list[QASample],
    positions: list[int],
    references: bool = False,
) -> list[Cell]:
    """All cells, sample-major: each sample's reference points first (with ``references``),
    then its positions in the order given."""
    out = []
    for s in samples:
        if references:
            out += [
                Cell(cell_id(config, s.id, REFERENCE_POSITION, r), s, REFERENCE_POSITION, r)
                for r in REFERENCES
            ]
        out += [Cell(cell_id(config, s.id, p), s, p) for p in positions]
    return out


def _prompt(cell: Cell):
    return task_prompt(cell.sample, cell.passages())


def stored_prompt(
    cell: Cell, read_prompt: Callable[[Prompt], Prompt] | None, chat: bool = True
) -> StoredPrompt:
    """What a record keeps of the prompt a backend read for ``cell``
    (:class:`~ragfix.types.StoredPrompt`): its user turn, assistant prefix and passage spans,
    and the index of the gold passage among them (found by its text in a rearranged prompt).

    Args:
        cell: the cell.
        read_prompt: the backend's :meth:`~ragfix.backends.Backend.read_prompt` (the task
            prompt, or its passages as the backend rearranged them); None for a backend that
            reads the task prompt as it is (what ``ragfix report --html`` rebuilds for a run
            made before records kept their prompts), which gives the same record.
        chat: whether the model read the prompt in a chat template
            (:attr:`~ragfix.backends.base.Backend.reads_chat_template`): the stored prefix is
            :meth:`~ragfix.prompts.TaskPrompt.answer_prefix`, what the model read between the
            user turn and its answer (a base model's completion prefix).
    """
    prompt = _prompt(cell)
    read = prompt if read_prompt is None else read_prompt(prompt)
    gold = cell.gold_index
    if read is not prompt and gold is not None:
        start, end = prompt.passages[gold]
        text = prompt.user[start:end]
        gold = next((i for i, (a, b) in enumerate(read.passages) if read.user[a:b] == text), None)
    return StoredPrompt(
        text=read.user,
        assistant_prefix=read.answer_prefix(chat),
        passages=list(read.passages),
        gold=gold,
    )


def _record(cell: Cell, backend: Backend, gen: Generation, flags: list[str]) -> SweepRecord:
    """The record of a cell: ``flags`` plus the backend's own (:attr:`Generation.flags`), with
    :func:`generation_extra` in ``extra`` and, without a local tokenizer,
    ``extra["token_counts"] = "server"``; the sample's question and gold answers and the prompt
    the backend read (:func:`stored_prompt`; for a cell flagged ``overflow``, which the model
    never read, the task prompt as it is: a backend that rearranges the passages with the model,
    ``attention-sort``, is not run for it), which the caller drops when the run keeps no
    prompts (:attr:`SweepConfig.log_prompts`); ``prompt_position`` is where the gold passage
    is in that prompt. A cell with an :data:`~ragfix.types.UNSCORED` flag is not scored
    (``correct`` False)."""
    flags, extra = cell_flags(cell.sample.answers, [*flags, *gen.flags])
    reader = None if OVERFLOW in flags else backend.read_prompt
    read = stored_prompt(cell, reader, backend.reads_chat_template)
    extra.update(generation_extra(gen))
    if not backend.has_tokenizer:
        extra["token_counts"] = "server"
    return SweepRecord(
        cell_id=cell.cell_id,
        sample_id=cell.sample.id,
        position=cell.position,
        reference=cell.reference,
        prompt_position=read.gold if OVERFLOW not in flags and read.gold is not None else -1,
        num_docs=len(cell.passages()),
        backend=backend.name,
        prompt_tokens=gen.prompt_tokens,
        prefill_tokens=gen.prefill_tokens,
        new_tokens=gen.new_tokens,
        answer=gen.text,
        correct=not UNSCORED.intersection(flags) and score_answer(cell.sample, gen.text),
        seconds=round(gen.seconds, 4),
        flags=flags,
        extra=extra,
        question=cell.sample.question,
        gold_answers=cell.sample.answers,
        prompt=read,
    )


def run_cells(
    backend: Backend,
    cells: list[Cell],
    on_record: Callable[[SweepRecord], None],
    prefix_reuse: bool = True,
    batch_size: int = 1,
) -> None:
    """Compute ``cells`` and hand each finished record to ``on_record`` as soon as it is done.

    The backend's verdict decides (:meth:`~ragfix.backends.Backend.fit`): a cell whose prompt
    does not fit is not run: its record has the flag ``overflow``, an empty answer, ``correct``
    False and no prefill or new tokens. With a backend that cuts long prompts by design
    (``backend.cuts_long_prompts``, the ``truncated`` baseline) the cell runs and is flagged
    ``cut_to_window``. A backend that cannot count tokens here (a remote model without a
    tokenizer, ``backend.has_tokenizer`` False) runs every cell and the same verdict is taken on
    the prompt tokens the server counted: a cell that did not fit, or that the server refused as
    too long, gets the same ``overflow`` record (its answer dropped).

    Each sample's cells (with prefix reuse), or each batch of cells, are checked just before
    they run, so a backend whose check costs a model pass (``attention-sort``) reports progress
    from the first sample on.

    Ctrl-C: a backend's :class:`~ragfix.errors.Interrupted` hands back the answers that had
    arrived; their records go to ``on_record`` before it is raised again.

    Args:
        backend: the model backend.
        cells: the cells to compute (already filtered to the unfinished ones).
        on_record: called once per cell, in completion order (e.g. the store's append).
        prefix_reuse: each sample's cells from the last gold position to the first over the KV
            cache of the prompt prefix they share (only where ``backend.supports_prefix_reuse``;
            otherwise the cells are batched by length): at ``batch_size`` 1 one cell at a time
            with the cache kept between them; above 1, up to ``batch_size`` cells of a sample
            prefilled the same way, then their answers decoded in one batch (a cache of
            ``batch_size`` rows of the longest prompt).
        batch_size: cells per forward batch.
    """

    def fitted(chunk: list[Cell]) -> list[tuple[Cell, Fit]]:
        runnable = []
        for c in chunk:
            fit = backend.fit(_prompt(c))  # size unknown without a tokenizer: checked afterwards
            if fit.runs:
                runnable.append((c, fit))
            else:
                n = fit.prompt_tokens
                gen = Generation(
                    text="", prompt_tokens=n, new_tokens=0, prefill_tokens=0, seconds=0
                )
                on_record(_record(c, backend, gen, [OVERFLOW]))
        return runnable

    if prefix_reuse and backend.supports_prefix_reuse:
        by_sample: dict[str, list[Cell]] = {}
        for c in cells:
            by_sample.setdefault(c.sample.id, []).append(c)
        for group in by_sample.values():
            runnable = sorted(fitted(group), key=lambda x: -x[0].position)
            for start in range(0, len(runnable), batch_size):
                chunk = runnable[start : start + batch_size]
                _run_chunk(backend, chunk, on_record, batch_size, prefix_reuse=True)
        return
    for start in range(0, len(cells), batch_size):
        runnable = fitted(cells[start : start + batch_size])
        if runnable:
            _run_chunk(backend, runnable, on_record, batch_size, prefix_reuse=False)


def _run_chunk(
    backend: Backend,
    chunk: list[tuple[Cell, Fit]],
    on_record: Callable[[SweepRecord], None],
    batch_size: int,
    prefix_reuse: bool,
) -> None:
    """One ``generate`` call for the cells of ``chunk``, each record handed to ``on_record``;
    on :class:`~ragfix.errors.Interrupted` the answers that had arrived first."""
    prompts = [_prompt(c) for c, _ in chunk]
    try:
        gens = backend.generate(prompts, batch_size=batch_size, prefix_reuse=prefix_reuse)
    except Interrupted as e:
        for i, gen in sorted(e.done.items()):
            c, fit = chunk[i]
            on_record(_checked(c, backend, gen, fit))
        raise
    for (c, fit), gen in zip(chunk, gens, strict=True):
        on_record(_checked(c, backend, gen, fit))


def _checked(cell: Cell, backend: Backend, gen: Generation, fit: Fit) -> SweepRecord:
    """The record of a cell that ran, with ``fit`` the backend's verdict taken before it ran:
    its flag (``cut_to_window``), and ``overflow`` (answer dropped, not scored) when the server
    refused the prompt or, for a backend that could not count it beforehand, when the verdict
    on the prompt tokens the server counted is ``overflow``."""
    flags = [fit.flag] if fit.flag else []
    if fit.prompt_tokens is None and fit.counted(gen.prompt_tokens).flag == OVERFLOW:
        flags = [*flags, OVERFLOW]
    if OVERFLOW in flags or OVERFLOW in gen.flags:
        gen = gen.model_copy(update={"text": "", "new_tokens": 0, "prefill_tokens": 0})
    return _record(cell, backend, gen, flags)


def split_scored(records: list[dict]) -> tuple[list[dict], list[dict], set[str]]:
    """The scored curve records, the scored reference records and the samples left out of the
    curve.

    A sample with a curve cell that is not scored (an :data:`~ragfix.types.UNSCORED` flag:
    ``overflow``, ``prompt_cut``, ``empty_answer``) is left out at every position and at its
    reference points, so each position's accuracy is over the same samples, and the reference
    points over those samples; a sample whose reference cell is not scored is left out of both
    reference points only (whether a run has reference points never changes its curve).
    Reference cells (``reference`` set) never count towards a curve.

    Returns:
        ``(scored, references, left_out)``: the scored curve records, the scored reference
        records, the ids of the samples left out of the curve.
    """
    curve = on_curves(records)
    left_out = {r["sample_id"] for r in curve if UNSCORED.intersection(r.get("flags", ()))}
    refs = [r for r in records if r.get("reference")]
    no_refs = left_out | {r["sample_id"] for r in refs if UNSCORED.intersection(r["flags"])}
    scored = [r for r in curve if r["sample_id"] not in left_out]
    return scored, [r for r in refs if r["sample_id"] not in no_refs], left_out


def summary_counts(records: list[dict]) -> tuple[list[dict], dict]:
    """The records that count towards accuracy (:func:`split_scored`), and the counts for
    ``summary.json``.

    Args:
        records: the run's records (dicts as stored).

    Returns:
        ``(scored, extra)``: ``scored`` the scored curve records; ``extra`` = ``{"cells":
        curve records, "scored_cells": len(scored), "excluded_samples": samples left out of
        the curve, "flags": {flag: {position or reference point: cells}},
        "empty_answer_reasons": {the server's reason: cells}, "cell_ids": the ids of all
        records, "references": reference_points of the scored reference cells}`` (positions as
        strings, then the reference points, :func:`~ragfix.eval.sweep_summary.flag_order`;
        ``references`` only when the run has scored reference cells). ``cell_ids`` tells a
        report which of a folder's cells the run reported
        (:func:`ragfix.eval.compare.load_run`).
    """
    scored, refs, left_out = split_scored(records)
    counts: dict[str, dict[str, int]] = {}
    for r in records:
        where = r.get("reference") or str(int(r["position"]))
        for f in r.get("flags", ()):
            per = counts.setdefault(f, {})
            per[where] = per.get(where, 0) + 1
    reasons = Counter(
        str(r.get("extra", {}).get(EMPTY_ANSWER, "no reason recorded"))
        for r in records
        if EMPTY_ANSWER in r.get("flags", ())
    )
    return scored, {
        "cells": len(on_curves(records)),
        "scored_cells": len(scored),
        "excluded_samples": len(left_out),
        "flags": {
            f: {p: per[p] for p in sorted(per, key=flag_order)} for f, per in sorted(counts.items())
        },
        "empty_answer_reasons": dict(sorted(reasons.items())),
        "cell_ids": [r["cell_id"] for r in records],
        **({"references": reference_points(reference_cells(refs))} if refs else {}),
    }


def reference_cells(records: list[dict]) -> dict[str, dict[str, dict[str, bool]]]:
    """``{curve label: {reference: {sample_id: correct}}}`` of the reference cells among
    ``records`` (``reference`` set; others ignored), references in the order of
    :data:`REFERENCES`."""
    out: dict[str, dict[str, dict[str, bool]]] = {}
    for r in records:
        if r.get("reference"):
            by_ref = out.setdefault(curve_label(r), {})
            by_ref.setdefault(r["reference"], {})[r["sample_id"]] = bool(r["correct"])
    return {
        label: {name: by_ref[name] for name in REFERENCES if name in by_ref}
        for label, by_ref in sorted(out.items())
    }


def reference_points(cells: dict[str, dict[str, dict[str, bool]]]) -> dict[str, dict[str, dict]]:
    """The accuracy of each reference point, per curve: ``{curve label: {reference: {"n",
    "correct", "accuracy", "low", "high"}}}`` (``low``, ``high``: its 95% Wilson interval).

    Args:
        cells: :func:`reference_cells`.
    """
    out: dict[str, dict[str, dict]] = {}
    for label, by_ref in cells.items():
        out[label] = {}
        for name, by_sample in by_ref.items():
            n, ok = len(by_sample), sum(by_sample.values())
            low, high = wilson_interval(ok, n)
            out[label][name] = {"n": n, "correct": ok, "accuracy": ok / n, "low": low, "high": high}
    return out


def open_store(out: Path, rank: int = 0, world_size: int = 1) -> JsonlStore:
    """The result store of ``out``: a single process appends to ``results.jsonl``; rank ``r`` of
    a multi-process run to ``results.rank{r}.jsonl``. Every store reads all of the folder's
    result files, so finished cells are skipped whoever computed them."""
    return folder_store(Path(out), RESULTS_FILE, "cell_id", _shard_name(rank, world_size))


def _shard_name(rank: int, world_size: int) -> str:
    return RESULTS_FILE if world_size == 1 else f"results.rank{rank}.jsonl"


def sweep_folder(out: Path, config: RunConfig, rank: int = 0, world_size: int = 1) -> RunFolder:
    """The run folder of a sweep (raw or pipeline): ``results*.jsonl`` keyed by ``cell_id``,
    rank ``r`` of a multi-process run appending to ``results.rank{r}.jsonl``; a restart also
    removes ``summary.json`` and ``curve.png``."""
    return RunFolder(
        out,
        config,
        results=RESULTS_FILE,
        key="cell_id",
        own=_shard_name(rank, world_size),
        outputs=(SUMMARY_FILE, PLOT_FILE),
    )
