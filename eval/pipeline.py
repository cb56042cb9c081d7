"""The position sweep through a real LlamaIndex, LangChain or Haystack pipeline (``ragfix
eval-pipeline --corpus DOCS --questions Q | --needles N | --questions-from MODEL [--framework
...]``).

The questions come from a question file, from needles planted in the corpus or from a model that
writes them about its chunks (:mod:`ragfix.connectors.questions`); the gold chunk of each is known.
For every question the real retriever (FAISS over all-MiniLM-L6-v2 or the chosen embedder, or BM25)
returns its top-k chunks; the gold chunk's rank among them is its natural rank (``natural_rank`` in
every record, beside the swept rank ``position``). If the gold chunk is not among them it replaces
the lowest-ranked one (``gold_added`` in the record). The candidate list is then permuted so the
gold chunk has retrieval rank ``r`` (the other chunks keep their retrieval order, the scores stay in
descending order), for every requested ``r``. Each cell runs the real query engine: the candidates
come out of a retriever, go through :class:`~ragfix.postprocessor.RagFixPostprocessor` with the
cell's strategy and through LlamaIndex response synthesis (``compact``: the chunks packed into one
prompt, one LLM call when they fit; LlamaIndex 0.14's ``simple_summarize`` pastes the Python repr of
a list into the prompt) with :class:`~ragfix.llm.RagFixLLM`. With ``framework="langchain"`` the same
candidates go through a LangChain chain (``ContextualCompressionRetriever`` with
:class:`~ragfix.integrations.langchain.RagFixCompressor`, the ``qa`` prompt,
:class:`~ragfix.integrations.langchain.RagFixChatModel`), with ``"haystack"`` through a Haystack
pipeline (:class:`~ragfix.integrations.haystack.RagFixRanker`, the ``qa`` prompt builder,
:class:`~ragfix.integrations.haystack.RagFixChatGenerator`): the same correction code and the same
prompt text, so the same cell gives the same prompt in every framework (the record's ``prompt_sha1``
is the SHA-1 of the prompt as the model read it). The record keeps the gold chunk's retrieval rank
(``position``, the x-axis), where it ended up in the prompt (``prompt_position``), whether the
context was cut and how many LLM calls were made. All strategies run on the same cells. Each
framework's engine lives beside its components in :mod:`ragfix.integrations` (:data:`ENGINES`).

A cell whose candidates do not fit the model's window in one prompt (the task's prompt with all
``top_k`` chunks, plus the answer budget) is not run: the postprocessor would drop chunks (maybe
the gold one) and the synthesizer split the context, so the cell would not measure a position. It
is recorded with the flag ``overflow`` and its question is left out of every curve, as in the raw
sweep (:func:`ragfix.eval.sweep.summary_counts`); so is the question of a remote model's cell
flagged ``empty_answer`` or ``prompt_cut``. ``summary.json``'s ``flags`` and the printed table
count flagged cells per rank.

Results go to a run folder (:class:`~ragfix.eval.run.RunFolder`, bound to the backend's identity
and the content of the corpus and the question file): ``results.jsonl`` (resumable: a cell id is
a hash of the question, rank, strategy, model, backend, retrieval settings and framework; each
cell stored as soon as it is done, so Ctrl-C keeps every finished cell and says how many), then
``summary.json`` and ``curve.png`` (one curve per strategy). The summary also holds, per
strategy, the accuracy weighted by how often the real retriever put the gold chunk at each rank
(``retrieval_weighted``): what a user of this retriever would see on average."""

from __future__ import annotations

import hashlib
import importlib
import json
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field
from rich.console import Console

from ragfix.backends import Backend, BackendRef
from ragfix.backends.base import require_plain_prompts
from ragfix.connectors.corpus import (
    DEFAULT_CHUNK_SIZE,
    QuestionRecord,
    build_corpus,
    locate_gold,
    needle_questions,
    read_questions,
    resolve_demo,
)
from ragfix.connectors.jsonl import SkipCounter
from ragfix.connectors.questions import (
    WRITTEN_QUESTIONS,
    WRITTEN_REPORT,
    check_question_source,
    write_question_file,
)
from ragfix.connectors.records import RecordRange, parse_records, select_records
from ragfix.connectors.synthetic import NeedleSettings, QuestionsFrom
from ragfix.correction import CorrectionSettings
from ragfix.errors import ConfigError, DataError
from ragfix.eval.merit import retrieval_weighted_merit
from ragfix.eval.progress import RunTally
from ragfix.eval.run import (
    RunConfig,
    RunFolder,
    RunKind,
    Store,
    backend_reference,
    input_fingerprints,
    run,
)
from ragfix.eval.shard import Shard
from ragfix.eval.sweep import LEGACY_TASK_FORMS, parse_positions, summary_counts, sweep_folder
from ragfix.eval.sweep_summary import build_summary, cells_by_curve, natural_ranks, write_summary
from ragfix.integrations import require_extra
from ragfix.integrations.engine import PipelineEngines
from ragfix.io import read_run_config
from ragfix.models import DEFAULT_EMBEDDER, check_hub_model
from ragfix.reorder import ATTENTION_STRATEGIES, check_strategy, load_profile
from ragfix.tasks import resolve_task

#: the layers the attention strategies average in a pipeline sweep (the correction default)
ATTENTION_LAYERS = CorrectionSettings.model_fields["attention_layers"].default


def _engines(module: str, name: str, *args) -> PipelineEngines:
    """Engines ``name`` of ``module`` built with ``args`` (the module imported only now: a
    framework of an extra is imported when it is used)."""
    return getattr(importlib.import_module(module), name)(*args)


ENGINES = {
    "llamaindex": partial(_engines, "ragfix.integrations.llama_index", "LlamaIndexEngines"),
    "langchain": partial(_engines, "ragfix.integrations.langchain", "LangChainEngines"),
    "haystack": partial(_engines, "ragfix.integrations.haystack", "HaystackEngines"),
}
"""The frameworks a pipeline sweep runs through (``--framework``): each one's engines
(:class:`~ragfix.integrations.engine.PipelineEngines`), called with the backend, the strategies,
the bias profile's accuracies, ``top_k`` and the attention rounds."""


class PipelineConfig(RunConfig):
    """What makes the results of a pipeline sweep's folder comparable (checked on every rerun,
    finished folders included: :class:`~ragfix.eval.run.RunFolder`). Frozen, validated when
    built; its request fields (all but ``identity`` and ``inputs``) are hashed into the cell ids.

    Attributes:
        corpus: the corpus (folder or JSONL, resolved path); its content is ``inputs["corpus"]``.
        questions: the question file (resolved path; for written questions the run folder's
            :data:`WRITTEN_QUESTIONS`), its content ``inputs["questions"]``; ``None`` for needles.
        needles: the needle settings (``--needles``, ``--needle-seed``), or ``None``.
        questions_from: the question-writing settings (``--questions-from``), or ``None``.
        records: the record range of the question file (``"800:1100"``,
            :func:`~ragfix.connectors.records.parse_records`: record ``i`` is line ``i + 1``),
            or ``None``: every record; a rerun with another range is refused.
        task: ``qa-pipeline``.
        qa_task: the QA task whose prompt, answer budget and scorer the pipeline's LLM reads
            (:mod:`ragfix.tasks`: ``qa``, ``qa-extractive``, ``qa-extractive-2shot`` or a
            repeated variant ``NAME:repeat-MODE``); ``qa_task_form`` its fingerprint
            (:meth:`~ragfix.tasks.Task.fingerprint`): a rerun under an edited task is refused.
        num_docs: ``top_k``, the chunks the retriever returns.
        model, backend, backend_options: as in :class:`~ragfix.eval.sweep.SweepConfig`.
        retriever: ``faiss`` or ``bm25``.
        chunk_size: chunk size in embedder tokens.
        embedder: the embedder (``all-minilm-l6-v2``: the embedded default; else a
            sentence-transformers model id or folder, whose content is ``inputs["embedder"]``).
        framework: ``llamaindex``, ``langchain`` or ``haystack``.
        log_prompts: whether each record keeps the text its model read (as
            :class:`~ragfix.eval.sweep.SweepConfig`: not in the cell ids, a rerun with the other
            setting refused, an older ``config.json`` without it reads as False).

    Fields added after folders were written (``ABSENT``) enter the cell ids only when they
    differ from what an older folder stands for, so an older run resumes.
    """

    run: Literal["pipeline"] = "pipeline"
    ABSENT: ClassVar[dict] = {
        "log_prompts": False,
        "needles": None,
        "questions_from": None,
        "embedder": DEFAULT_EMBEDDER,
        "qa_task": "qa",
        "qa_task_form": LEGACY_TASK_FORMS["qa"],
        "records": None,
    }
    corpus: str
    questions: str | None
    records: RecordRange = None
    needles: NeedleSettings | None = None
    questions_from: QuestionsFrom | None = None
    task: Literal["qa-pipeline"] = "qa-pipeline"
    qa_task: str = "qa"
    qa_task_form: str = LEGACY_TASK_FORMS["qa"]
    num_docs: int = Field(ge=1)
    model: str
    backend: str
    backend_options: dict = Field(default_factory=dict)
    retriever: Literal["faiss", "bm25"] = "faiss"
    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, ge=1)
    embedder: str = DEFAULT_EMBEDDER
    framework: str = "llamaindex"
    log_prompts: bool = True

    def questions_of(
        self, path: Path, skip_invalid: bool, skipped: SkipCounter
    ) -> list[QuestionRecord]:
        """The question file's records (:func:`~ragfix.connectors.corpus.read_questions`, every
        record checked) in :attr:`records`.

        Raises:
            DataError: a malformed record (unless ``skip_invalid``), or none in the range.
        """
        read = read_questions(path, skip_invalid, skipped)
        if self.records is None:
            return read
        chosen = select_records(read, parse_records(self.records))
        if not chosen:
            what = f"--records {self.records} holds none of its {len(read)} questions"
            raise DataError(path, None, None, what)
        return chosen


def pipeline_cell_id(
    config: PipelineConfig, question_id: str, rank: int, strategy: str, extra: dict
) -> str:
    """Deterministic 16-hex id of a pipeline cell (from the request, not the bound identity
    nor whether records keep their prompts; a later field at its ``ABSENT`` value left out)."""
    request = config.model_dump(mode="json", exclude={"identity", "inputs", "log_prompts"})
    request = {k: v for k, v in request.items() if k not in config.ABSENT or v != config.ABSENT[k]}
    key = json.dumps([question_id, rank, strategy, request, extra], sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def run_pipeline_sweep(
    corpus: Path,
    questions: Path | None,
    out: Path,
    strategies: list[str],
    top_k: int = 10,
    positions: str = "all",
    limit: int | None = None,
    records: str | None = None,
    model: str = "smollm2",
    backend: str | Backend | BackendRef = "vanilla",
    adapter: str | Path | None = None,
    backend_options: dict | None = None,
    profile: Path | None = None,
    retriever: str = "faiss",
    skip_invalid: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    console: Console | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    attention_rounds: int = 1,
    framework: str = "llamaindex",
    restart: bool = False,
    shard: str | Shard | None = None,
    log_prompts: bool = True,
    needles: NeedleSettings | None = None,
    questions_from: QuestionsFrom | None = None,
    writer_options: dict | None = None,
    embedder: str | None = None,
    orders: dict | None = None,
    task: str = "qa",
    repeat: str = "none",
) -> dict:
    """Run the position sweep through a LlamaIndex, LangChain or Haystack pipeline; returns the
    summary dict.

    The questions come from one of ``questions`` (a file), ``needles`` (facts planted in the
    corpus, :func:`~ragfix.connectors.synthetic.plant_needles`) or ``questions_from`` (written
    by a model, :func:`~ragfix.connectors.synthetic.write_questions`, into the run folder's
    :data:`WRITTEN_QUESTIONS`, kept for reruns and reuse with ``--questions``; what its filter
    dropped goes to :data:`WRITTEN_REPORT` and the summary's ``written_questions``).

    Args:
        corpus: a document folder or JSONL corpus (``demo``: the bundled NQ demo corpus); never
            written (its index lives in the ragfix cache:
            :func:`~ragfix.connectors.corpus.index_dir`).
        questions: the question file (``demo``: the bundled NQ demo questions), or ``None``.
        out: run folder (``results.jsonl``, ``summary.json``, ``curve.png``); resumable.
        strategies: reorder strategies to compare (see :mod:`ragfix.reorder`).
        top_k: chunks the retriever returns (the number of documents in the prompt).
        positions: gold retrieval ranks to test (0-based; ``all``, ``first,middle,last``, ``0,4``),
            or ``natural``: each question only at the rank the retriever itself gave its gold
            chunk (the questions whose gold chunk it did not retrieve are left out, counted in
            the summary's ``gold_added``): the pipeline as a user runs it, whose accuracy over
            the questions is the ``retrieval_weighted`` figure, at one cell per question and
            strategy. Its cells are those of the same ranks in a sweep over every rank.
        limit: use the first ``limit`` usable questions (of ``records``).
        records: the record range of the question file, given or written (``"START:END"``,
            :func:`~ragfix.connectors.records.parse_records`; record ``i`` is line ``i + 1``),
            before ``limit``: every record is still checked; part of the run config (a rerun
            with another range is refused). Not with ``needles``.
        model, backend, adapter, backend_options, device, dtype: the model backend (see
            :func:`ragfix.backends.load_backend`); the options (but a remote model's call
            settings) and the adapter path are part of the cell ids. A remote model
            (``openai:NAME``) needs a ``tokenizer`` option here: passages are fitted to the
            window by counting their tokens. Instead of a name, ``backend`` may be a
            :class:`~ragfix.backends.BackendRef` or a loaded backend (used in this process),
            which bring their own settings (:func:`~ragfix.eval.run.backend_reference`), so
            ``model``, ``adapter``, ``backend_options``, ``orders``, ``device`` and ``dtype``
            are not given with it.
        profile: ``summary.json`` for ``bias-profile`` (same model, ``top_k`` documents).
        retriever: ``faiss`` or ``bm25``.
        skip_invalid: skip and count malformed questions and unreadable files.
        console: where progress and notes go (``None``: quiet); the tables are the caller's
            (:func:`ragfix.cli.eval_pipeline_cmd.print_pipeline_run`).
        chunk_size: chunk size in embedder tokens.
        attention_rounds: rounds of the attention strategies (``attention-sort``,
            ``attention-sort-calibrated``; their layers are the default,
            :data:`ATTENTION_LAYERS`, which is part of their cell ids).
        framework: ``llamaindex``, ``langchain`` or ``haystack`` (the last two need their extra):
            the pipeline the cells run through; part of the run's config and cell ids. The same
            cell gives the same prompt in each (``prompt_sha1`` in the records).
        shard: compute one job's part of the run only, ``"i/N"`` or a
            :class:`~ragfix.eval.shard.Shard` (0-based): its own result file in ``out``, its
            manifest, no summary (it returns a :class:`~ragfix.eval.run.ShardDone`); join the
            shards with :func:`~ragfix.eval.merge.merge_runs`.
        restart: start ``out`` over when it holds a run of other settings, weights or inputs
            (corpus, questions), instead of refusing it.
        log_prompts: keep in each record the text its model read (the question and gold
            answers are kept either way); see :func:`ragfix.eval.run_sweep`.
        needles: plant and ask needles (no ``limit``); the settings are part of the run config
            and the index key, so a rerun asks the same needles.
        questions_from: the model, number of chunks and seed of written questions; written once
            per folder (again with ``restart``).
        writer_options: the writing model's backend options (a served model's ``api_base``...).
        embedder: the sentence-transformers model id or folder of the index (``None``: the
            embedded all-MiniLM-L6-v2).
        orders: order marginalization's settings
            (:class:`~ragfix.backends.orders.OrderOptions`: ``orders``, ``design``,
            ``aggregate``, ``seed``): each pipeline's LLM component answers over several orders
            of the chunks its correction component passed on (``passages_from``), every
            order's answer kept in the records (``extra["votes"]``); validated before anything
            is loaded, part of the cell ids (as ``backend_options["orders"]``) and of the
            backend's identity, so a run folder is never resumed onto other orders.
        task: the QA task every framework's pipeline renders and scores (``qa``,
            ``qa-extractive``, ``qa-extractive-2shot``, a repeated variant ``NAME:repeat-MODE``:
            :func:`ragfix.tasks.get_task`); recorded with its fingerprint.
        repeat: read the chunks (``passages``) or the whole prompt (``prompt``) twice
            (:func:`ragfix.tasks.resolve_task`: the task becomes ``TASK:repeat-MODE``); not with
            ``orders``. The attention strategies sort the chunks on the task's prompt read once
            (:attr:`ragfix.tasks.Task.once`); the LLM reads them twice.

    Raises:
        ConfigError, DataError, CorpusError, NeedleError, ProfileError, ModelNotFoundError: bad
            input (one line), e.g. not exactly one source of questions, a backend that reads
            passages only where a task prompt says they are (a framework's prompt is text:
            refused before indexing), or no written question passing the filter (the files
            that are copies of others named).
        ConfigMismatchError: ``out`` holds a run of other settings, weights or corpus or
            question contents (not with ``restart``).
        Interrupted: Ctrl-C: every cell finished before it is stored (cells run one at a
            time, each stored as soon as its answer is in); its message says how many this run
            stored and where. The cell in flight is not stored: a rerun computes it and the
            other missing ones.
        pydantic.ValidationError: an unknown or invalid backend option or order setting.
        ConfigError: (among the above) more ``orders`` than ``top_k`` chunks have distinct
            orders (:func:`~ragfix.backends.orders.check_orders`).
    """
    from ragfix.backends import backend_class, result_options, validate_backend
    from ragfix.backends.orders import OrderOptions, check_orders
    from ragfix.models import resolve_model

    ref, loaded = backend_reference(
        backend, model=model, adapter=adapter, backend_options=backend_options, orders=orders,
        device=device, dtype=dtype,
    )  # fmt: skip
    backend, model, adapter, orders = ref.name, ref.model, ref.adapter, ref.orders
    options = ref.options
    corpus = resolve_demo(Path(corpus), "corpus")
    if questions is not None:
        questions = resolve_demo(Path(questions), "questions")
    check_question_source(questions, needles, questions_from)
    if needles is not None and (limit is not None or records is not None):
        what = "--limit" if limit is not None else "--records"
        raise ConfigError(f"{what} picks questions of a file: --needles N sets their number")
    if records is not None:
        parse_records(records)  # a malformed range refused before anything is read
    strategies = [check_strategy(s) for s in dict.fromkeys(strategies)]
    if not strategies:
        raise ConfigError("--strategy: give at least one strategy")
    if retriever not in ("faiss", "bm25"):
        raise ConfigError(f"--retriever: {retriever!r} is not faiss or bm25")
    if framework not in ENGINES:
        raise ConfigError(f"--framework: {framework!r} is not one of {', '.join(ENGINES)}")
    if framework != "llamaindex":
        require_extra(framework)
    require_plain_prompts(backend_class(backend, model), f"the {framework} pipeline", backend)
    order_options = None if orders is None else OrderOptions(**orders)
    if order_options is not None:
        check_orders(order_options, top_k)
    resolve_model(model)
    accuracies = None
    if "bias-profile" in strategies:
        if profile is None:
            raise ConfigError("strategy bias-profile needs --profile (a sweep's summary.json)")
        accuracies = load_profile(profile, model, top_k)
    ranks = None if positions.strip() == "natural" else parse_positions(positions, top_k)
    qa_task = resolve_task(task, repeat, "qa", reads_passages=orders is not None)
    if embedder is not None and not Path(embedder).is_dir():
        check_hub_model(embedder)
    written = Path(out) / WRITTEN_QUESTIONS if questions_from is not None else None
    write_now = written is not None and (
        restart or read_run_config(out) is None or not written.exists()
    )
    if written is not None:
        validate_backend("vanilla", model=questions_from.model, **(writer_options or {}))
        resolve_model(questions_from.model)
        if not write_now:
            questions = written  # this folder's questions, checked against its config below
    asked = written or questions  # the question file, once there is one
    skipped = SkipCounter()
    ref = ref.model_copy(update={"orders": order_options.model_dump() if order_options else None})
    config = PipelineConfig(
        corpus=str(Path(corpus).resolve()),
        questions=None if asked is None else str(Path(asked).resolve()),
        records=records,
        needles=needles,
        questions_from=questions_from,
        qa_task=qa_task.name,
        qa_task_form=qa_task.fingerprint(),
        num_docs=top_k,
        model=model,
        backend=backend,
        backend_options={
            **result_options(options, ref.validated),
            **({"adapter": adapter} if adapter else {}),
            **({"orders": order_options.model_dump()} if order_options else {}),
        },
        retriever=retriever,
        chunk_size=chunk_size,
        embedder=embedder or DEFAULT_EMBEDDER,
        framework=framework,
        log_prompts=log_prompts,
        inputs=input_fingerprints(
            corpus=corpus,
            questions=questions,
            embedder=embedder if embedder and Path(embedder).is_dir() else None,
        ),
        backend_ref=ref,
    )
    # the question file read and checked before anything is indexed
    chosen = None if questions is None else config.questions_of(questions, skip_invalid, skipped)
    kind = PipelineRun(
        config,
        Path(out),
        corpus=corpus,
        embedder=embedder,
        questions=questions,
        records=chosen,
        skipped=skipped,
        limit=limit,
        skip_invalid=skip_invalid,
        strategies=strategies,
        ranks=ranks,
        accuracies=accuracies,
        attention_rounds=attention_rounds,
        written=written if write_now else None,
        writer_options=writer_options,
    )
    return run(
        kind,
        ref if loaded is None else loaded,
        out,
        restart=restart,
        shard=Shard.parse(shard),
        console=console,
    )


class _PipelineTally(RunTally):
    """The running accuracy, after the strategy of the cell just stored."""

    def add(self, record: dict) -> str:
        return f"{record.get('strategy', 'none')} {super().add(record)}"


@dataclass(eq=False)
class PipelineRun(RunKind):
    """The pipeline sweep as a run kind (:func:`ragfix.eval.run.run`): the corpus is indexed
    and the questions read, written or planted once the backend is loaded; its cells are
    (question, retrieval rank, strategy), run one at a time through the framework's pipelines;
    the summary adds the retrieval-weighted accuracy per strategy (:func:`run_pipeline_sweep`).

    Attributes:
        config, out: the run's configuration and folder.
        corpus, embedder: what is indexed, and by which embedder (``None``: the default).
        questions, records: the question file and its records (``None`` for needles or
            questions still to write).
        limit, skip_invalid, strategies, ranks, accuracies, attention_rounds: as
            :func:`run_pipeline_sweep` takes them (``ranks`` parsed, ``accuracies`` the bias
            profile's or ``None``).
        written: where to write the questions (``questions_from``), or ``None``: none to write.
        writer_options: the writing model's backend options.
        skipped: counts the inputs skipped with ``skip_invalid`` (the questions read so far).
    """

    config: PipelineConfig
    out: Path
    corpus: Path
    embedder: str | None
    questions: Path | None
    records: list[QuestionRecord] | None
    limit: int | None
    skip_invalid: bool
    strategies: list[str]
    ranks: list[int] | None
    accuracies: list[float] | None
    attention_rounds: int
    written: Path | None
    writer_options: dict | None
    skipped: SkipCounter = field(default_factory=SkipCounter)
    label = "pipeline sweep"
    skips = "input"

    def folder(self, out: Path) -> RunFolder:
        self.run_folder = sweep_folder(out, self.config)
        return self.run_folder

    def _busy(self, text: str):
        return self.console.status(text) if self.console else nullcontext()

    def setup(self, backend) -> None:
        """Index the corpus, write the questions when asked (with ``backend`` itself when the
        writer is the same plain model) and find each question's gold chunk."""
        from ragfix.backends import load_backend

        c, out, skipped = self.config, self.out, self.skipped
        self.backend = backend
        corpus = self.corpus
        with self._busy(f"indexing {corpus} (once per content and settings)"):
            self.cor = cor = build_corpus(
                corpus, self.embedder, chunk_size=c.chunk_size, skipped=skipped, needles=c.needles
            )
        self.needle_ids = frozenset(n.node_id for n in cor.needles)
        self.base = cor.retriever(c.retriever, c.num_docs + max(len(self.needle_ids) - 1, 0))
        questions, records = self.questions, self.records
        if self.written is not None:
            qf, ref = c.questions_from, c.backend_ref
            # the answering model writes the questions too when it is the same plain model
            same = (qf.model, ref.name, ref.adapter) == (c.model, "vanilla", None)
            writer = backend
            if not (same and not self.writer_options):
                writer = load_backend(
                    "vanilla",
                    model=qf.model,
                    device=ref.device,
                    dtype=ref.dtype,
                    **(self.writer_options or {}),
                )
            with self._busy(f"{qf.model} writes questions"):
                questions = write_question_file(writer, cor, qf, out)
            del writer
            folder = self.run_folder
            folder.config = folder.config.model_copy(
                update={"inputs": {**c.inputs, **input_fingerprints(questions=questions)}}
            )
            records = c.questions_of(questions, self.skip_invalid, skipped)
        if c.needles is not None:
            self.qs = needle_questions(cor.needles)
        else:
            self.qs = locate_gold(
                questions, records, cor.nodes, self.limit, self.skip_invalid, skipped
            )

    def cells(self) -> list[tuple[str, tuple]]:
        """Every (question, rank, strategy) with its id; the retriever's candidates of each
        question are fetched here."""

        def cid(q, r, s):
            extra = {"profile": self.accuracies} if s == "bias-profile" else {}
            if s in ATTENTION_STRATEGIES:
                extra = {
                    "attention_rounds": self.attention_rounds,
                    "attention_layers": ATTENTION_LAYERS,
                }
            return pipeline_cell_id(self.run_folder.config, q.id, r, s, extra)

        top_k = self.config.num_docs
        self.retrieved = {q.id: _retrieve(self.base, q, top_k, self.needle_ids) for q in self.qs}

        def ranks(q) -> list[int]:  # natural: the retriever's own rank, none when it missed
            natural = self.retrieved[q.id][1]
            return self.ranks if self.ranks is not None else [] if natural is None else [natural]

        cells = [
            (q, r, s, cid(q, r, s)) for q in self.qs for r in ranks(q) for s in self.strategies
        ]
        return [(c[3], c) for c in cells]

    def compute(self, todo: list[tuple], store: Store, batch_size: int) -> None:
        c = self.config
        engines = ENGINES[c.framework](
            self.backend,
            self.strategies,
            self.accuracies,
            c.num_docs,
            self.attention_rounds,
            c.qa_task,
        )
        planned = engines.plan(todo, self.retrieved, {n.node_id: n for n in self.cor.nodes})
        for cands, (q, r, s, cell) in planned:
            rec = engines.run(q, r, s, cell, cands, self.retrieved[q.id][1])
            if not c.log_prompts:
                rec = rec.model_copy(update={"prompt": None})
            store(rec.model_dump())

    def tally(self, finished: list[dict]) -> RunTally:
        return _PipelineTally(finished)

    def summarize(self, folder: RunFolder, records: list[dict]) -> dict:
        c, qs, retrieved, out = self.config, self.qs, self.retrieved, self.out
        if not records:
            raise DataError(out, None, None, "no finished cells")
        natural = Counter(retrieved[q.id][1] for q in qs)
        extra = {
            "skipped_inputs": self.skipped.count,
            "questions": len(qs),
            "strategies": self.strategies,
            "retriever": c.retriever,
            "framework": c.framework,
            "gold_added": sum(1 for q in qs if retrieved[q.id][1] is None),
            "ranks": "natural" if self.ranks is None else self.ranks,
            "natural_rank_counts": {str(k): v for k, v in sorted(natural.items(), key=str)},
            "question_source": "needles"
            if c.needles
            else "written"
            if c.questions_from
            else "file",
            "index": str(self.cor.where),
            "context_cut_cells": sum(1 for r in records if r.get("extra", {}).get("context_cut")),
            "strategy_settings": {
                "profile": self.accuracies,
                "attention_rounds": self.attention_rounds,
                "attention_layers": ATTENTION_LAYERS,
            },
        }
        if c.questions_from is not None and (out / WRITTEN_REPORT).exists():
            extra["written_questions"] = json.loads((out / WRITTEN_REPORT).read_text())
        scored, counts = summary_counts(records)
        summary = build_summary(out, scored, {**extra, **counts})
        ranks = natural_ranks(scored) or {}
        summary["retrieval_weighted"] = {
            label: m.accuracy
            for label, cells in cells_by_curve(scored).items()
            if (m := retrieval_weighted_merit(cells, ranks, resamples=0)) is not None
        }
        write_summary(out, summary)
        return summary


def _retrieve(retriever, q, top_k: int, needles: frozenset[str] = frozenset()) -> tuple:
    """The retriever's top-``top_k`` for question ``q`` and the gold chunk's rank among them
    (None when it was not retrieved). The chunks of ``needles`` other than ``q``'s own gold are
    left out (the retriever returns ``top_k + len(needles) - 1``), so a needle question is
    answered among the corpus's own chunks, as if its needle were the only one planted."""
    res = [
        n
        for n in retriever.retrieve(q.question)
        if n.node.node_id == q.gold_node_id or n.node.node_id not in needles
    ][:top_k]
    ids = [n.node.node_id for n in res]
    return res, ids.index(q.gold_node_id) if q.gold_node_id in ids else None
