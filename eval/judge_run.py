"""Resumable judge runs: the Python API behind ``ragfix judge``.

A run folder holds:

* ``judgments.jsonl``: one :class:`~ragfix.judge.PairJudgment` per pair, append-only (keyed by
  ``pair_id``), each stored as soon as it is judged (on Ctrl-C, also the pairs of the batch in
  flight both of whose replies had arrived); a rerun judges only the pairs not in it;
* ``config.json``: a :class:`JudgeConfig`: the settings (data, model, backend, options, adapter,
  judge settings), the backend's identity (weights, adapter) and the pair file's content
  fingerprint, checked on every rerun (:class:`~ragfix.eval.run.RunFolder`). It is written when
  the first judgment is computed, so a run that fails before (a bad option, a budget that does
  not fit) leaves no configuration behind and a corrected rerun can use the same folder;
* ``summary.json`` and ``judge.png``: metrics and plot of the pairs of this data
  (:func:`ragfix.judge.summarize`, :func:`ragfix.judge.plot_judges`). The summary is a result
  file (``"kind": "ragfix-judge"``, with ``data``, its ``format`` and ``limit``): copied under
  ``results/``, it renders as the ``judge`` table kind (:func:`ragfix.judge.report.judge_tables`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field
from rich.console import Console

from ragfix.backends import Backend, BackendRef
from ragfix.connectors.records import format_records, parse_records
from ragfix.errors import ConfigError, DataError
from ragfix.eval.run import (
    RunConfig,
    RunFolder,
    RunKind,
    backend_reference,
    default_batch_size,
    input_fingerprints,
    run,
)
from ragfix.eval.shard import Shard
from ragfix.io import CONFIG_FILE, atomic_write_json
from ragfix.judge import (
    PairwiseJudge,
    check_judge_settings,
    plot_judges,
    summarize,
    summarize_swap_judgments,
)
from ragfix.judge.judge import pair_layouts
from ragfix.judge.report import JUDGE_KIND, SWAP_JUDGMENTS_FORMAT
from ragfix.types import OVERFLOW, JudgePair

JUDGMENTS_FILE = "judgments.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "judge.png"


@dataclass
class JudgeRunResult:
    """What a judge run produced.

    Attributes:
        out: the run folder.
        summaries: ``{judge name: summary}`` (:func:`ragfix.judge.summarize`), one entry for a
            judged run, one per evaluator for other judges' verdicts.
        pairs: pairs of the data (after ``limit``); 0 for other judges' verdicts.
        computed: pairs judged by this call.
        reused: pairs already in ``judgments.jsonl`` (a resumed run).
        skipped_records: malformed records skipped with ``skip_invalid``.
        skipped_examples: the first few of their errors.
        notes: what the reader must know about the figures (e.g. no logit verdict because the
            server returned no log-probabilities); also in ``summary.json``.
    """

    out: Path
    summaries: dict[str, dict]
    pairs: int = 0
    computed: int = 0
    reused: int = 0
    skipped_records: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def files(self) -> dict[str, Path]:
        """The files of the run folder, by role (``judgments`` only for a judged run)."""
        out = {"summary": self.out / SUMMARY_FILE, "plot": self.out / PLOT_FILE}
        if self.pairs:
            out["judgments"] = self.out / JUDGMENTS_FILE
        return out


def _write_report(out: Path, summaries: dict[str, dict], extra: dict, title: str) -> None:
    """Write ``summary.json`` (a ``ragfix-judge`` result file: ``extra`` holds the data as
    given, its format and the limit, then the run's details) and ``judge.png``."""
    atomic_write_json(out / SUMMARY_FILE, {"kind": JUDGE_KIND, **extra, "judges": summaries})
    plot_judges(summaries, out / PLOT_FILE, title)


def summarize_judgments(
    data: str | Path, out: str | Path, limit: int | None = None
) -> JudgeRunResult:
    """Metrics of the verdicts other judges gave in both orders (LLMBar swap judgments), per
    judge; writes ``summary.json`` and ``judge.png`` into ``out``.

    Args:
        data: a swap-judgments file (:func:`ragfix.connectors.pairwise.load_swap_judgments`).
        out: the folder to write into.
        limit: use the first ``limit`` items of each evaluator.

    Returns:
        a :class:`JudgeRunResult` with one summary per evaluator.

    Raises:
        DataError: a missing or malformed record.
    """
    from ragfix.connectors.pairwise import load_swap_judgments

    data, out = Path(data), Path(out)
    per_judge = load_swap_judgments(data, limit)
    summaries = {ev: summarize_swap_judgments(rows) for ev, rows in per_judge.items()}
    out.mkdir(parents=True, exist_ok=True)
    extra = {"data": str(data), "format": SWAP_JUDGMENTS_FORMAT, "limit": limit}
    _write_report(out, summaries, extra, f"{data.name}: swap judgments")
    return JudgeRunResult(out=out, summaries=summaries)


class JudgeConfig(RunConfig):
    """What makes the judgments of one folder comparable (checked on every rerun, finished
    folders included: :class:`~ragfix.eval.run.RunFolder`). Frozen, validated when built.

    Attributes:
        data: the pair file (resolved path); its content is ``inputs["data"]``.
        format: the pair file's format (:func:`ragfix.connectors.pairwise.detect_format`).
        model, backend, backend_options, adapter: the judge model (the options without a
            remote model's call settings; the adapter's resolved path).
        style, max_new_tokens, repeats, tie_margin, swap, labels, calibrate: the judge settings
            (:class:`ragfix.judge.PairwiseJudge`).
        mtbench_models: for MT-bench answers, the two models compared, else None.
        kv_wrong: for KV-retrieval records, where the wrong answer comes from
            (:func:`ragfix.connectors.pairwise.load_kv_pairs`).
    """

    #: folders written before the letter prior could be removed: MT-bench letters, uncalibrated
    ABSENT: ClassVar[dict] = {"labels": "slot", "calibrate": "none", "kv_wrong": "context"}

    run: Literal["judge"] = "judge"
    data: str
    format: str
    model: str
    backend: str
    backend_options: dict = Field(default_factory=dict)
    adapter: str | None = None
    style: str
    max_new_tokens: int | None = None
    repeats: int = 1
    tie_margin: float = 0.0
    swap: str = "relabel"
    labels: str = "slot"
    calibrate: str = "none"
    mtbench_models: list[str] | None = None
    kv_wrong: Literal["context", "unsupported"] = "context"


def _load_pairs(
    data: Path, limit, skip_invalid: bool, mtbench_models, records=None, kv_wrong="context"
):
    """The pairs of ``data`` (of the record range ``records``, a slice, when given; then the
    first ``limit`` of them) and the skip counter.

    Raises:
        DataError: a malformed record (unless ``skip_invalid``), or no pairs at all.
    """
    from ragfix.connectors.jsonl import SkipCounter
    from ragfix.connectors.pairwise import load_pairs
    from ragfix.connectors.records import select_records

    skipped = SkipCounter()
    pairs = load_pairs(
        data, None if records else limit, skip_invalid, skipped, mtbench_models, kv_wrong=kv_wrong
    )
    if records is not None:
        pairs = select_records(pairs, records)[:limit]
    if not pairs:
        raise DataError(data, None, None, "no pairs to judge")
    return pairs, skipped


class _JudgeTally:
    """The judge's running figure: position consistency over the pairs judged so far."""

    def __init__(self, finished: list[dict]) -> None:
        self.n = len(finished)
        self.consistent = sum(bool(r["consistent"]) for r in finished)

    def add(self, record: dict) -> str:
        self.n += 1
        self.consistent += bool(record["consistent"])
        return self.status()

    def status(self) -> str:
        return f"consistent {self.consistent / self.n:.2f}" if self.n else ""


class JudgeRun(RunKind):
    """The judge as a run kind (:func:`ragfix.eval.run.run`): its cells are the pairs (by
    ``pair_id``), each judged in both orders by a :class:`~ragfix.judge.PairwiseJudge`; the
    summary is :func:`ragfix.judge.summarize` of the pairs of this data."""

    key = "pair_id"
    unit = "pair"
    finished = "judged"

    def __init__(
        self, config: JudgeConfig, pairs: list[JudgePair], settings: dict, extra: dict, skipped
    ):
        self.config, self.pairs, self.settings, self.extra = config, pairs, settings, extra
        self.skipped = skipped
        self.label = f"judging ({config.backend})"
        self.computed = 0

    def folder(self, out: Path) -> RunFolder:
        outputs = (SUMMARY_FILE, PLOT_FILE)
        return RunFolder(out, self.config, results=JUDGMENTS_FILE, key="pair_id", outputs=outputs)

    def setup(self, backend) -> None:
        self.backend = backend
        device = self.config.backend_ref.device
        size = self.settings.pop("batch_size") or default_batch_size(backend, device, self)
        self.judge = PairwiseJudge(backend, batch_size=size, **self.settings)

    def batch_size(self, on_gpu: bool) -> int:
        return 32 if on_gpu else 4

    def cells(self) -> list[tuple[str, JudgePair]]:
        return [(p.pair_id, p) for p in self.pairs]

    def compute(self, todo: list[JudgePair], store, batch_size: int) -> None:
        self.computed = len(todo)
        self.judge.judge_pairs(todo, lambda res: store(res.model_dump(mode="json")))

    def tally(self, finished: list[dict]) -> _JudgeTally:
        return _JudgeTally(finished)

    def summarize(self, folder: RunFolder, records: list[dict]) -> JudgeRunResult:
        c, judge = self.config, self.judge
        name = f"{c.model} · {c.backend}" + (f" · swap {c.swap}" if c.swap != "relabel" else "")
        name += f" · {c.labels} letters" if c.labels != "slot" else ""
        name += f" · {c.calibrate} calibration" if c.calibrate != "none" else ""
        summary = summarize(records)
        judged = [r for r in records if OVERFLOW not in r.get("flags", ())]  # never asked
        orders = [o for r in judged for o in (r["original"], r["swapped"])]
        missing = sum(o.get("p_a") is None for o in orders)
        notes = []
        if c.style == "verdict" and missing:
            notes.append(
                f"no logit verdict: the server returned no logprobs ({missing} of {len(orders)} "
                "judged orders have none)"
            )
        if c.calibrate != "none":  # also for a finished folder: the priors are in the figures
            for p in self.pairs:
                for lay in pair_layouts(p, c.swap, c.labels):
                    judge.letter_prior(lay, bool(p.reference))
        extra = {
            **self.extra,
            "content_free": (
                {"priors": judge.priors, "passes": judge.prior_passes}
                if c.calibrate != "none"
                else None
            ),
            "config": folder.config.stored(),
            "skipped_records": self.skipped.count,
            "torn_lines": folder.store.torn_lines,
            "notes": notes,
        }
        data = Path(self.extra["data"])
        _write_report(
            folder.out, {name: summary}, extra, f"{data.name}: {name} as judge ({c.style})"
        )
        return JudgeRunResult(
            out=folder.out,
            summaries={name: summary},
            pairs=len(self.pairs),
            computed=self.computed,
            reused=len(self.pairs) - self.computed,
            skipped_records=self.skipped.count,
            skipped_examples=list(self.skipped.examples),
            notes=notes,
        )


def run_judge(
    data: str | Path,
    out: str | Path,
    *,
    model: str = "smollm2",
    backend: str | Backend | BackendRef = "vanilla",
    adapter: str | None = None,
    backend_options: dict | None = None,
    style: str = "verdict",
    limit: int | None = None,
    repeats: int = 1,
    max_new_tokens: int | None = None,
    tie_margin: float = 0.0,
    swap: str = "relabel",
    labels: str = "slot",
    calibrate: str = "none",
    records: str | None = None,
    batch_size: int | None = None,
    mtbench_models: tuple[str, str] = ("gpt-4", "gpt-3.5-turbo"),
    kv_wrong: str = "context",
    skip_invalid: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    restart: bool = False,
    shard: str | Shard | None = None,
    console: Console | None = None,
) -> JudgeRunResult:
    """Judge every pair of ``data`` in both orders with a backend, resumably, into ``out``.

    Pairs already in ``out/judgments.jsonl`` are not judged again (their records are reused)
    once the folder's configuration, the judge model's identity and the pair file's content
    agree with this call's (:class:`~ragfix.eval.run.RunFolder`; the model is loaded to check,
    also when every pair is judged). A file of other judges' verdicts
    (LLMBar swap judgments) is summarised instead (:func:`summarize_judgments`). Metrics: position
    consistency, preference fairness, first-slot win rate, agreement with human labels (Zheng et
    al. 2023, section 3.4; Shi et al. 2024, section 3).

    Args:
        data: pairs (LLMBar, PandaLM, MT-bench answers, or JSON Lines with ``question``,
            ``answer_a``, ``answer_b``, optional ``label``), see
            :mod:`ragfix.connectors.pairwise`.
        out: the run folder (created).
        model, backend, adapter, backend_options: what judges (:func:`ragfix.backends.
            load_backend`).
            Instead of a name, a :class:`~ragfix.backends.BackendRef` or a loaded backend
            (used in this process), which bring their own settings
            (:func:`~ragfix.eval.run.backend_reference`), so ``model``, ``adapter``,
            ``backend_options``, ``device`` and ``dtype`` are not given with it; not one
            marginalized over orders.
        style, repeats, max_new_tokens, tie_margin, swap, labels, calibrate, batch_size: see
            :class:`ragfix.judge.PairwiseJudge` (``batch_size`` default: 32 on CUDA, 4 on CPU,
            1 for a bf16 or fp16 model on the CPU: :func:`~ragfix.eval.run.default_batch_size`).
        limit: judge the first ``limit`` pairs (of ``records`` when given).
        records: judge the pairs of the record range ``"START:END"`` (record ``i`` on line
            ``i + 1`` of the file; :mod:`ragfix.connectors.records`), e.g. a held-out range
            disjoint from the one a judge option was chosen on.
        mtbench_models: for MT-bench answers, the two models to compare.
        kv_wrong: for KV-retrieval records, where the wrong answer comes from: ``context`` or
            ``unsupported`` (:func:`ragfix.connectors.pairwise.load_kv_pairs`).
        skip_invalid: skip and count malformed records instead of stopping.
        device, dtype: where and how to load the model.
        shard: compute one job's part of the run only, ``"i/N"`` or a
            :class:`~ragfix.eval.shard.Shard` (0-based): its own result file in ``out``, its
            manifest, no summary (it returns a :class:`~ragfix.eval.run.ShardDone`); join the
            shards with :func:`~ragfix.eval.merge.merge_runs`.
        restart: start ``out`` over when it holds judgments of other settings, weights or pair
            file contents, instead of refusing it.
        console: a rich console for messages and the progress bar (None: quiet).

    Returns:
        a :class:`JudgeRunResult`: the summary of the pairs of ``data`` and what was computed.

    Raises:
        DataError: a malformed record, no pairs, or a corrupt ``config.json``.
        ConfigError: bad judge settings, an unknown backend, a missing adapter, or a token
            budget that does not fit the backend.
        ConfigMismatchError: ``out`` holds judgments made with another configuration, other
            weights (the backend's identity) or another content of the pair file, or written
            before run folders recorded them (not with ``restart``).
        ModelNotFoundError, AdapterError: the model or adapter cannot be used.
        Interrupted: Ctrl-C, once every pair both of whose replies had arrived is judged and
            stored (:meth:`~ragfix.judge.PairwiseJudge.judge_pairs`); its message says how many
            pairs this run stored and where. A rerun judges only the others.
        pydantic.ValidationError: an unknown or invalid backend option.
    """
    from ragfix.connectors.pairwise import detect_format
    from ragfix.models.resolve import resolve_model

    ref, loaded = backend_reference(
        backend, model=model, adapter=adapter, backend_options=backend_options, device=device,
        dtype=dtype,
    )  # fmt: skip
    if ref.orders is not None:
        raise ConfigError("a judge's prompt has no passages to reorder: no order marginalization")
    if ref.adapter:  # the judge's folders record the adapter's absolute path
        ref = ref.model_copy(update={"adapter": str(Path(ref.adapter).resolve())})
    backend, model = ref.name, ref.model
    data, out = Path(data), Path(out)
    fmt = detect_format(data)
    if fmt == "swap_judgments":
        return summarize_judgments(data, out, limit)
    check_judge_settings(style, repeats, swap, labels, calibrate)
    span = parse_records(records) if records is not None else None
    if len(mtbench_models) != 2:
        raise ConfigError(f"mtbench_models needs two model names, got {list(mtbench_models)}")
    opts = ref.validated
    resolve_model(model)
    pairs, skipped = _load_pairs(data, limit, skip_invalid, mtbench_models, span, kv_wrong)
    config = JudgeConfig(
        data=str(data.resolve()),
        format=fmt,
        model=model,
        backend=backend,
        backend_options=opts.model_dump(mode="json", exclude=set(opts.call_settings)),
        adapter=ref.adapter,
        style=style,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        tie_margin=tie_margin,
        swap=swap,
        labels=labels,
        calibrate=calibrate,
        mtbench_models=list(mtbench_models) if fmt == "mtbench" else None,
        kv_wrong=kv_wrong,
        inputs=input_fingerprints(data=data),
        backend_ref=ref,
    )
    settings = dict(
        style=style,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        tie_margin=tie_margin,
        batch_size=batch_size,
        swap=swap,
        labels=labels,
        calibrate=calibrate,
    )
    extra = {
        "data": str(data),
        "format": fmt,
        "limit": limit,
        "records": format_records(span) if span is not None else None,
        "kv_wrong": kv_wrong if fmt == "kv" else None,
    }
    kind = JudgeRun(config, pairs, settings, extra, skipped)
    return run(
        kind,
        ref if loaded is None else loaded,
        out,
        restart=restart,
        shard=Shard.parse(shard),
        console=console,
    )


def compare_runs(baseline: str | Path, other: str | Path, field: str = "verdict_original") -> dict:
    """Whether two judge runs on the same pairs agree with the labels differently: the exact
    McNemar test (:func:`ragfix.metrics.mcnemar_exact`) of one verdict field of their
    ``judgments.jsonl`` (``verdict_original``: the one-pass verdict) over the labelled pairs
    both judged (overflowing pairs left out).

    Returns:
        ``{"pairs", "baseline_correct", "other_correct", "only_other", "only_baseline",
        "p_value"}``.

    Raises:
        RagfixError: the runs share no labelled pair.
    """
    from ragfix.errors import RagfixError
    from ragfix.io import JsonlStore
    from ragfix.judge.metrics import paired_agreement, verdict_correct

    def correct(folder) -> dict[str, bool]:
        store = JsonlStore(Path(folder) / JUDGMENTS_FILE, key="pair_id")
        return verdict_correct(store.load().values(), field)

    result = paired_agreement(correct(baseline), correct(other))
    if result is None:
        raise RagfixError(f"{baseline} and {other} share no labelled pair")
    return result


__all__ = [
    "compare_runs",
    "CONFIG_FILE",
    "JUDGMENTS_FILE",
    "PLOT_FILE",
    "SUMMARY_FILE",
    "JudgeRunResult",
    "run_judge",
    "summarize_judgments",
]
