"""The position sweep through a real LlamaIndex, LangChain or Haystack pipeline (``ragfix eval
--corpus DOCS --questions Q | --needles N | --questions-from MODEL [--framework ...]``).

The questions come from a question file, from needles planted in the corpus or from a model that
writes them about its chunks (:mod:`ragfix.connectors.synthetic`); the gold chunk of each is known.
For every question the real retriever (FAISS over all-MiniLM-L6-v2 or the chosen embedder, or BM25)
returns its top-k chunks; the gold chunk's rank among them is its natural rank (``natural_rank`` in
every record, beside the swept rank ``position``). If the gold chunk is not among them it replaces
the lowest-ranked one (``gold_added`` in the record). The candidate list is then permuted so the
gold chunk has retrieval rank ``r`` (the other chunks keep their retrieval order, the scores stay
in descending order), for every requested ``r``. Each cell runs the real query engine: the
candidates come out of a retriever, go through :class:`~ragfix.postprocessor.RagFixPostprocessor`
with the cell's strategy and through LlamaIndex response synthesis (``compact``: the chunks packed
into one prompt, one LLM call when they fit; LlamaIndex 0.14's ``simple_summarize`` pastes the
Python repr of a list into the prompt) with :class:`~ragfix.llm.RagFixLLM`. With
``framework="langchain"`` the same candidates go through a LangChain chain
(``ContextualCompressionRetriever`` with :class:`~ragfix.integrations.langchain.RagFixCompressor`,
the ``qa`` prompt, :class:`~ragfix.integrations.langchain.RagFixChatModel`), with ``"haystack"``
through a Haystack pipeline (:class:`~ragfix.integrations.haystack.RagFixRanker`, the ``qa`` prompt
builder, :class:`~ragfix.integrations.haystack.RagFixChatGenerator`): the same correction code and
the same prompt text, so the same cell gives the same prompt in every framework (the record's
``prompt_sha1`` is the SHA-1 of the prompt as the model read it). The record keeps the gold chunk's
retrieval rank (``position``, the x-axis), where it ended up in the prompt (``prompt_position``),
whether the context was cut and how many LLM calls were made. All strategies run on the same cells.

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
import json
import os
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field
from rich.console import Console
from rich.table import Table

from ragfix.backends import BackendRef
from ragfix.backends.base import Fit, require_plain_prompts
from ragfix.connectors.corpus import (
    DEFAULT_CHUNK_SIZE,
    build_corpus,
    describe_copies,
    locate_gold,
    needle_questions,
    read_questions,
    resolve_demo,
)
from ragfix.connectors.jsonl import SkipCounter
from ragfix.connectors.synthetic import NeedleSettings, QuestionsFrom, write_questions
from ragfix.correction import CorrectionSettings
from ragfix.errors import ConfigError, DataError
from ragfix.eval.merit import retrieval_weighted_merit
from ragfix.eval.progress import RunTally
from ragfix.eval.run import RunConfig, RunFolder, RunKind, Store, input_fingerprints, run
from ragfix.eval.sweep import (
    OVERFLOW,
    cell_flags,
    generation_extra,
    parse_positions,
    summary_counts,
    sweep_folder,
)
from ragfix.eval.sweep_summary import (
    build_summary,
    cells_by_curve,
    natural_ranks,
    print_flags,
    print_run_files,
    print_summary,
    write_summary,
)
from ragfix.integrations import require_extra
from ragfix.io import atomic_write_json, atomic_write_text, read_run_config
from ragfix.models import DEFAULT_EMBEDDER, check_hub_model
from ragfix.prompts import TaskPrompt
from ragfix.reorder import ATTENTION_STRATEGIES, check_strategy, load_profile
from ragfix.tasks import get_task, join_chunks
from ragfix.types import UNSCORED, StoredPrompt, SweepRecord

#: the layers the attention strategies average in a pipeline sweep (the correction default)
ATTENTION_LAYERS = CorrectionSettings.model_fields["attention_layers"].default
#: the run folder's file of LLM-written questions (``--questions-from``; a question file that
#: ``--questions`` reads) and the count of what its filter dropped
WRITTEN_QUESTIONS = "questions.jsonl"
WRITTEN_REPORT = "questions-filter.json"


def _fixed_retriever_class():
    from llama_index.core.retrievers import BaseRetriever

    class FixedRetriever(BaseRetriever):
        """Returns the node list it was last given (the permuted candidates of a cell)."""

        def __init__(self) -> None:
            super().__init__()
            self.nodes: list = []

        def _retrieve(self, query_bundle):
            return list(self.nodes)

    return FixedRetriever


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
        task: ``qa-pipeline``.
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
    }
    corpus: str
    questions: str | None
    needles: NeedleSettings | None = None
    questions_from: QuestionsFrom | None = None
    task: Literal["qa-pipeline"] = "qa-pipeline"
    num_docs: int = Field(ge=1)
    model: str
    backend: str
    backend_options: dict = Field(default_factory=dict)
    retriever: Literal["faiss", "bm25"] = "faiss"
    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, ge=1)
    embedder: str = DEFAULT_EMBEDDER
    framework: str = "llamaindex"
    log_prompts: bool = True


def pipeline_cell_id(
    config: PipelineConfig, question_id: str, rank: int, strategy: str, extra: dict
) -> str:
    """Deterministic 16-hex id of a pipeline cell (from the request, not the bound identity
    nor whether records keep their prompts; a later field at its ``ABSENT`` value left out)."""
    request = config.model_dump(mode="json", exclude={"identity", "inputs", "log_prompts"})
    request = {k: v for k, v in request.items() if k not in config.ABSENT or v != config.ABSENT[k]}
    key = json.dumps([question_id, rank, strategy, request, extra], sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def check_question_source(questions, needles, questions_from) -> None:
    """Exactly one source of questions for a pipeline sweep.

    Raises:
        ConfigError: none or several of a question file, needles and a question-writing model.
    """
    flags = ("--questions", "--needles", "--questions-from")
    sources = (questions, needles, questions_from)
    given = [f for f, v in zip(flags, sources, strict=True) if v is not None]
    if len(given) != 1:
        raise ConfigError(
            "pipeline mode needs one source of questions: --questions FILE, --needles N or "
            f"--questions-from MODEL (given: {' and '.join(given) or 'none'})"
        )


def candidates_with_gold_at(retrieved: list, gold, rank: int) -> list:
    """The retrieved ``NodeWithScore`` list with the gold node moved to 0-based ``rank``.

    The other nodes keep their retrieval order; the scores of ``retrieved`` (sorted descending,
    ``None`` kept) are reassigned by list position so the order and the scores agree.
    """
    from llama_index.core.schema import NodeWithScore

    others = [n for n in retrieved if n.node.node_id != gold.node.node_id]
    others = others[: len(retrieved) - 1]
    order = [*others[:rank], gold, *others[rank:]]
    scores = [n.score for n in retrieved]
    if all(s is not None for s in scores):
        scores = sorted(scores, reverse=True)
    return [NodeWithScore(node=n.node, score=s) for n, s in zip(order, scores, strict=True)]


def run_pipeline_sweep(
    corpus: Path,
    questions: Path | None,
    out: Path,
    strategies: list[str],
    top_k: int = 10,
    positions: str = "all",
    limit: int | None = None,
    model: str = "smollm2",
    backend: str = "vanilla",
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
    log_prompts: bool = True,
    needles: NeedleSettings | None = None,
    questions_from: QuestionsFrom | None = None,
    writer_options: dict | None = None,
    embedder: str | None = None,
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
        positions: gold retrieval ranks to test (0-based; ``all``, ``first,middle,last``, ``0,4``).
        limit: use the first ``limit`` usable questions.
        model, backend, adapter, backend_options, device, dtype: the model backend (see
            :func:`ragfix.backends.load_backend`); the options (but a remote model's call
            settings) and the adapter path are part of the cell ids. A remote model
            (``openai:NAME``) needs a ``tokenizer`` option here: passages are fitted to the
            window by counting their tokens.
        profile: ``summary.json`` for ``bias-profile`` (same model, ``top_k`` documents).
        retriever: ``faiss`` or ``bm25``.
        skip_invalid: skip and count malformed questions and unreadable files.
        console: where progress and notes go (``None``: quiet); the tables are the caller's
            (:func:`print_pipeline_run`).
        chunk_size: chunk size in embedder tokens.
        attention_rounds: rounds of the attention strategies (``attention-sort``,
            ``attention-sort-calibrated``; their layers are the default,
            :data:`ATTENTION_LAYERS`, which is part of their cell ids).
        framework: ``llamaindex``, ``langchain`` or ``haystack`` (the last two need their extra):
            the pipeline the cells run through; part of the run's config and cell ids. The same
            cell gives the same prompt in each (``prompt_sha1`` in the records).
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
        pydantic.ValidationError: an unknown or invalid backend option.
    """
    from ragfix.backends import backend_class, result_options, validate_backend
    from ragfix.models import resolve_model

    options = dict(backend_options or {})
    adapter = str(adapter) if adapter else None
    corpus = resolve_demo(Path(corpus), "corpus")
    if questions is not None:
        questions = resolve_demo(Path(questions), "questions")
    check_question_source(questions, needles, questions_from)
    if needles is not None and limit is not None:
        raise ConfigError("--limit picks questions of a file: --needles N sets their number")
    strategies = [check_strategy(s) for s in dict.fromkeys(strategies)]
    if not strategies:
        raise ConfigError("--strategy: give at least one strategy")
    if retriever not in ("faiss", "bm25"):
        raise ConfigError(f"--retriever: {retriever!r} is not faiss or bm25")
    if framework not in ENGINES:
        raise ConfigError(f"--framework: {framework!r} is not one of {', '.join(ENGINES)}")
    if framework != "llamaindex":
        require_extra(framework)
    validated = validate_backend(backend, adapter, model=model, **options)
    require_plain_prompts(backend_class(backend, model), f"the {framework} pipeline", backend)
    resolve_model(model)
    accuracies = None
    if "bias-profile" in strategies:
        if profile is None:
            raise ConfigError("strategy bias-profile needs --profile (a sweep's summary.json)")
        accuracies = load_profile(profile, model, top_k)
    ranks = parse_positions(positions, top_k)
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
    records = None
    if questions is not None:
        records = read_questions(questions, skip_invalid, skipped)  # fails before indexing
    ref = BackendRef(
        name=backend, model=model, adapter=adapter, options=options, device=device, dtype=dtype
    )
    config = PipelineConfig(
        corpus=str(Path(corpus).resolve()),
        questions=None if asked is None else str(Path(asked).resolve()),
        needles=needles,
        questions_from=questions_from,
        num_docs=top_k,
        model=model,
        backend=backend,
        backend_options={
            **result_options(options, validated),
            **({"adapter": adapter} if adapter else {}),
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
    kind = PipelineRun(
        config,
        Path(out),
        corpus=corpus,
        embedder=embedder,
        questions=questions,
        records=records,
        skipped=skipped,
        limit=limit,
        skip_invalid=skip_invalid,
        strategies=strategies,
        ranks=ranks,
        accuracies=accuracies,
        attention_rounds=attention_rounds,
        written=written if write_now else None,
        writer_options=writer_options,
        console=console,
    )
    return run(kind, ref, out, restart=restart, console=console)


class _PipelineTally(RunTally):
    """The running accuracy, after the strategy of the cell just stored."""

    def add(self, record: dict) -> str:
        return f"{record.get('strategy', 'none')} {super().add(record)}"


class PipelineRun(RunKind):
    """The pipeline sweep as a run kind (:func:`ragfix.eval.run.run`): the corpus is indexed
    and the questions read, written or planted once the backend is loaded; its cells are
    (question, retrieval rank, strategy), run one at a time through the framework's pipelines;
    the summary adds the retrieval-weighted accuracy per strategy (:func:`run_pipeline_sweep`).
    """

    label = "pipeline sweep"

    def __init__(self, config: PipelineConfig, out: Path, **settings) -> None:
        self.config, self.out = config, out
        self.__dict__.update(settings)

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
                batch = writer.preferred_batch_size or 8
                made = write_questions(writer, cor.nodes, qf, batch)
            del writer
            copies = {"copies": cor.copies} if cor.copies else {}
            if not made.records:
                why = ", ".join(f"{k} {v}" for k, v in made.dropped.items())
                if cor.copies:
                    why += (
                        f"; {len(cor.copies)} file(s) of {corpus} are copies of others, and an "
                        "answer in one is in its copy too (answer_in_other_chunk): "
                        f"{describe_copies(cor.copies)}; remove the copies"
                    )
                raise DataError(
                    self.written, None, None, f"no written question passed the filter ({why})"
                )
            atomic_write_text(self.written, "".join(json.dumps(r) + "\n" for r in made.records))
            atomic_write_json(out / WRITTEN_REPORT, {"model": qf.model, **made.report(), **copies})
            questions = self.written
            folder = self.run_folder
            folder.config = folder.config.model_copy(
                update={"inputs": {**c.inputs, **input_fingerprints(questions=questions)}}
            )
            records = read_questions(questions, self.skip_invalid, skipped)
        if c.needles is not None:
            self.qs = needle_questions(cor.needles)
        else:
            self.qs = locate_gold(
                questions, records, cor.nodes, self.limit, self.skip_invalid, skipped
            )
        if skipped.count and self.console is not None:
            self.console.print(
                f"[yellow]skipped {skipped.count} input(s)[/yellow]; first: {skipped.examples[0]}",
                highlight=False,
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

        cells = [
            (q, r, s, cid(q, r, s)) for q in self.qs for r in self.ranks for s in self.strategies
        ]
        top_k = self.config.num_docs
        self.retrieved = {q.id: _retrieve(self.base, q, top_k, self.needle_ids) for q in self.qs}
        return [(c[3], c) for c in cells]

    def compute(self, todo: list[tuple], store: Store, batch_size: int) -> None:
        c = self.config
        engines = ENGINES[c.framework](
            self.backend, self.strategies, self.accuracies, c.num_docs, self.attention_rounds
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
        if not folder.check():
            folder.write_config()
        natural = Counter(retrieved[q.id][1] for q in qs)
        extra = {
            "skipped_inputs": self.skipped.count,
            "questions": len(qs),
            "strategies": self.strategies,
            "retriever": c.retriever,
            "framework": c.framework,
            "gold_added": sum(1 for q in qs if retrieved[q.id][1] is None),
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


def print_pipeline_run(summary: dict, out: Path, console: Console) -> None:
    """What ``ragfix eval --corpus`` prints for a finished pipeline sweep: what the filter of
    written questions dropped, the per-rank tables, the flagged cells, the strategies and where
    the files are."""
    c = summary["config"]
    w = summary.get("written_questions")
    if w:
        drops = ", ".join(f"{k} {v}" for k, v in w["dropped"].items())
        if w.get("copies"):
            drops += f"; copies in the corpus: {describe_copies(w['copies'])}"
        console.print(
            f"questions written by {w['model']}: {w['kept']} of {w['asked']} kept; dropped: "
            f"{drops} ({out / WRITTEN_QUESTIONS})",
            highlight=False,
            soft_wrap=True,
        )
    title = f"{c['model']} · {c['backend']} · top-{c['num_docs']} · {c['retriever']} · "
    if c.get("needles"):
        title += f"{c['needles']['count']} needles · "
    print_summary(summary, console, title=title + c["framework"])
    print_flags(summary, console)
    print_strategies(summary, console)
    print_run_files(out, console)


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


def _chunk(node) -> str:
    """A candidate node as the LLM reads it (``Document (Title: t) text``)."""
    from llama_index.core.schema import MetadataMode

    return node.node.get_content(metadata_mode=MetadataMode.LLM)


def _read_prompt(text: str, chunks: list[str], ids: list[str], q) -> StoredPrompt:
    """The prompt a pipeline's model read (``text``, as its LLM component sent it) with the
    spans of the ``chunks`` it holds verbatim (in prompt order, each searched after the one
    before; a chunk the framework rewrote has no span) and the gold chunk's index among them
    (None when it is not among them)."""
    spans, gold, start = [], None, 0
    for chunk, node_id in zip(chunks, ids, strict=True):
        at = text.find(chunk.strip(), start)
        if at < 0:
            continue
        if node_id == q.gold_node_id:
            gold = len(spans)
        start = at + len(chunk.strip())
        spans.append((at, start))
    return StoredPrompt(text=text, passages=spans, gold=gold)


def _parts(node) -> tuple[str, str, str, float | None]:
    """``(id, title, bare text, score)`` of a candidate node, for another framework's
    document type."""
    from llama_index.core.schema import MetadataMode

    content = node.node.get_content(metadata_mode=MetadataMode.NONE)
    return node.node.node_id, str(node.node.metadata.get("title", "")), content, node.score


class _Engines:
    """One pipeline per strategy in a framework, over a backend and a retriever that returns the
    cell's candidates (the ``qa`` task's prompt, all kept chunks in one prompt); :meth:`run`
    answers one cell and builds its record. Subclasses build the framework's pipelines
    (:meth:`_build`), run the correction alone (:meth:`_order`) and query a pipeline
    (:meth:`_query`); ``self.llms[s]`` is strategy ``s``'s LLM component (``calls``,
    ``last_prompt``, ``last_generation``) and ``self.posts[s]`` its correction component
    (``last_report``)."""

    framework = ""

    def __init__(self, backend, strategies, accuracies, top_k: int, attention_rounds: int):
        self.backend, self.top_k = backend, top_k
        self.fit: dict[str, Fit] = {}  # cell id -> the backend's verdict on its prompt
        self.answer = {"max_new_tokens": 32, "stop_at_newline": True, "prefix_reuse": True}
        self.llms: dict = {}
        self.posts: dict = {}
        for s in strategies:
            self._build(
                s,
                {
                    "strategy": s,
                    "profile": accuracies if s == "bias-profile" else None,
                    "num_docs": top_k if s == "bias-profile" else None,
                    "dedup_threshold": None,  # every strategy reads the same k chunks
                    "attention_rounds": attention_rounds,
                },
            )

    def _build(self, s: str, settings: dict) -> None:
        raise NotImplementedError

    def _order(self, s: str, cands: list) -> list[str]:
        """Node ids of ``cands`` after strategy ``s``'s correction alone."""
        raise NotImplementedError

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        """Strategy ``s``'s pipeline on ``question`` with ``cands`` retrieved: the node ids the
        LLM read, in prompt order, and the answer."""
        raise NotImplementedError

    def plan(self, todo: list, retrieved: dict, by_id: dict) -> list[tuple[list, tuple]]:
        """``(candidates, cell)`` for every cell, in run order: per question, static strategies
        sorted by their final node order (neighbours share long prompt prefixes, which the
        LLM's KV-cache reuse exploits), attention-sort last, cells that overflow the window
        (:meth:`fits`, computed here once per cell) first (they run nothing)."""
        from llama_index.core.schema import NodeWithScore

        keyed = []
        for cell in todo:
            q, r, s, _ = cell
            res, _nat = retrieved[q.id]
            gold = next((n for n in res if n.node.node_id == q.gold_node_id), None)
            if gold is None:
                gold = NodeWithScore(node=by_id[q.gold_node_id], score=None)
            cands = candidates_with_gold_at(res, gold, r)
            self.fit[cell[3]] = self.fits(q.question, cands)
            if not self.fit[cell[3]].runs:
                key = (q.id, -1, [n.node.node_id for n in cands])
            elif s in ATTENTION_STRATEGIES:
                key = (q.id, 1, [n.node.node_id for n in cands])
            else:
                key = (q.id, 0, self._order(s, cands))
            keyed.append((key, cands, cell))
        keyed.sort(key=lambda x: x[0])
        return [(cands, cell) for _key, cands, cell in keyed]

    def run(self, q, r: int, s: str, cell: str, cands: list, natural: int | None) -> SweepRecord:
        """Query strategy ``s``'s pipeline with ``cands`` as the retrieved nodes; the record of
        cell ``cell`` (gold at retrieval rank ``r``), with the prompt the model read
        (:func:`_read_prompt`) and its SHA-1 (``prompt_sha1``: the same cell gives the same
        prompt in every framework). When the
        candidates do not fit the window in one prompt (:meth:`fits`) nothing runs: the record is
        flagged ``overflow`` (a backend that cuts long prompts by design runs it, flagged
        ``cut_to_window``)."""
        fit = self.fit.get(cell) or self.fits(q.question, cands)
        if not fit.runs:
            return self._overflow(q, r, s, cell, fit.prompt_tokens, natural)
        llm = self.llms[s]
        calls = llm.calls
        start = time.perf_counter()
        final_ids, answer = self._query(s, q.question, cands)
        secs = time.perf_counter() - start
        by_id = {n.node.node_id: n for n in cands}
        seen = llm.last_prompt or ""
        prompt = " ".join(seen.split())  # white space may change
        cut = any(" ".join(_chunk(by_id[i]).split()) not in prompt for i in final_ids)
        gen = llm.last_generation
        rep = self.posts[s].last_report
        flags, explained = cell_flags(q.answers, [*([fit.flag] if fit.flag else []), *gen.flags])
        explained.update(generation_extra(gen))
        return SweepRecord(
            cell_id=cell,
            sample_id=q.id,
            position=r,
            prompt_position=final_ids.index(q.gold_node_id) if q.gold_node_id in final_ids else -1,
            num_docs=self.top_k,
            backend=self.backend.name,
            strategy=s,
            prompt_tokens=gen.prompt_tokens,
            prefill_tokens=gen.prefill_tokens,
            new_tokens=gen.new_tokens,
            answer=answer,
            correct=not UNSCORED.intersection(flags) and get_task("qa").score(answer, q.answers),
            seconds=round(secs, 4),
            flags=flags,
            question=q.question,
            gold_answers=q.answers,
            prompt=_read_prompt(seen, [_chunk(by_id[i]) for i in final_ids], final_ids, q),
            extra={
                **explained,
                "framework": self.framework,
                "gold_added": natural is None,
                "natural_rank": natural,
                "context_cut": cut,
                "llm_calls": llm.calls - calls,
                "prompt_sha1": hashlib.sha1(seen.encode()).hexdigest(),
                "dropped": len(rep.get("dropped_duplicates", []))
                + len(rep.get("dropped_budget", [])),
                "order": rep.get("order"),
            },
        )

    def fits(self, question: str, cands: list) -> Fit:
        """The backend's verdict (:meth:`~ragfix.backends.Backend.fit`) on the ``qa`` prompt
        with every candidate chunk (as every framework renders them, in candidate order) and the
        answer budget."""
        user = get_task("qa").user_turn(question, join_chunks([_chunk(n) for n in cands]))
        prompt = TaskPrompt(user=user, max_new_tokens=self.answer["max_new_tokens"])
        return self.backend.fit(prompt)

    def _overflow(self, q, r: int, s: str, cell: str, n: int, natural: int | None) -> SweepRecord:
        """The record of a cell that was not run: its prompt of ``n`` tokens does not fit."""
        flags, explained = cell_flags(q.answers, [OVERFLOW])
        return SweepRecord(
            cell_id=cell,
            sample_id=q.id,
            position=r,
            prompt_position=-1,
            num_docs=self.top_k,
            backend=self.backend.name,
            strategy=s,
            prompt_tokens=n,
            prefill_tokens=0,
            new_tokens=0,
            answer="",
            correct=False,
            seconds=0.0,
            flags=flags,
            question=q.question,
            gold_answers=q.answers,
            extra={
                **explained,
                "framework": self.framework,
                "gold_added": natural is None,
                "natural_rank": natural,
            },
        )


class _LlamaIndexEngines(_Engines):
    """LlamaIndex: a query engine per strategy (a retriever returning the cell's candidates,
    :class:`~ragfix.postprocessor.RagFixPostprocessor`, ``compact`` synthesis with
    :class:`~ragfix.llm.RagFixLLM`, one shared LLM)."""

    framework = "llamaindex"

    def _build(self, s: str, settings: dict) -> None:
        from llama_index.core import get_response_synthesizer
        from llama_index.core.indices.prompt_helper import PromptHelper
        from llama_index.core.query_engine import RetrieverQueryEngine

        from ragfix.llm import RagFixLLM
        from ragfix.postprocessor import RagFixPostprocessor, text_qa_template

        if not self.llms:
            self.llm = RagFixLLM(self.backend, **self.answer)
            self.fixed = _fixed_retriever_class()()
            self.engines: dict = {}
        self.llms[s] = self.llm
        self.posts[s] = RagFixPostprocessor(backend=self.backend, **settings)
        helper = PromptHelper(
            context_window=self.llm.metadata.context_window,
            num_output=self.llm.metadata.num_output,
            tokenizer=self.backend.tokenize,
        )
        synth = get_response_synthesizer(
            llm=self.llm,
            response_mode="compact",
            text_qa_template=text_qa_template("qa"),
            prompt_helper=helper,
        )
        self.engines[s] = RetrieverQueryEngine(
            retriever=self.fixed, response_synthesizer=synth, node_postprocessors=[self.posts[s]]
        )

    def _order(self, s: str, cands: list) -> list[str]:
        return [n.node.node_id for n in self.posts[s].postprocess_nodes(cands)]

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        self.fixed.nodes = cands
        resp = self.engines[s].query(question)
        return [n.node.node_id for n in resp.source_nodes], str(resp.response or "")


class _LangChainEngines(_Engines):
    """LangChain: a chain per strategy (a ``ContextualCompressionRetriever`` with
    :class:`~ragfix.integrations.langchain.RagFixCompressor` over a retriever returning the
    cell's candidates, the ``qa`` prompt, :class:`~ragfix.integrations.langchain.RagFixChatModel`,
    one shared chat model)."""

    framework = "langchain"

    def _build(self, s: str, settings: dict) -> None:
        from operator import itemgetter

        from langchain_classic.retrievers import ContextualCompressionRetriever
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.retrievers import BaseRetriever
        from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough

        from ragfix.integrations.langchain import (
            RagFixChatModel,
            RagFixCompressor,
            format_documents,
            qa_prompt,
        )

        if not self.llms:

            class FixedRetriever(BaseRetriever):
                """Returns the document list it was last given (the cell's candidates)."""

                docs: list = []

                def _get_relevant_documents(self, query, *, run_manager=None):
                    return list(self.docs)

            self.chat = RagFixChatModel(self.backend, **self.answer)
            self.fixed = FixedRetriever()
            self.chains: dict = {}
        self.llms[s] = self.chat
        self.posts[s] = RagFixCompressor(backend=self.backend, **settings)
        retriever = ContextualCompressionRetriever(
            base_compressor=self.posts[s], base_retriever=self.fixed
        )
        answer = (
            {
                "context": itemgetter("docs") | RunnableLambda(format_documents),
                "question": itemgetter("question"),
            }
            | qa_prompt()
            | self.chat
            | StrOutputParser()
        )
        self.chains[s] = RunnableParallel(docs=retriever, question=RunnablePassthrough()).assign(
            answer=answer
        )

    @staticmethod
    def _docs(cands: list) -> list:
        from langchain_core.documents import Document

        return [
            Document(page_content=text, metadata={"title": title, "score": score}, id=i)
            for i, title, text, score in map(_parts, cands)
        ]

    def _order(self, s: str, cands: list) -> list[str]:
        return [d.id for d in self.posts[s].compress_documents(self._docs(cands), "")]

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        self.fixed.docs = self._docs(cands)
        out = self.chains[s].invoke(question)
        return [d.id for d in out["docs"]], out["answer"]


class _HaystackEngines(_Engines):
    """Haystack: a pipeline per strategy (the cell's candidates as the ranker's input,
    :class:`~ragfix.integrations.haystack.RagFixRanker`, the ``qa`` prompt builder,
    :class:`~ragfix.integrations.haystack.RagFixChatGenerator`; a generator per pipeline, as a
    Haystack component belongs to one pipeline, all over the same backend)."""

    framework = "haystack"

    def _build(self, s: str, settings: dict) -> None:
        os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # offline evaluation
        from haystack import Pipeline

        from ragfix.integrations.haystack import (
            RagFixChatGenerator,
            RagFixRanker,
            qa_prompt_builder,
        )

        if not self.llms:
            self.pipes: dict = {}
        self.posts[s] = RagFixRanker(backend=self.backend, **settings)
        self.llms[s] = RagFixChatGenerator(self.backend, **self.answer)
        pipe = Pipeline()
        pipe.add_component("ranker", self.posts[s])
        pipe.add_component("prompt", qa_prompt_builder())
        pipe.add_component("llm", self.llms[s])
        pipe.connect("ranker.context", "prompt.context")
        pipe.connect("prompt.prompt", "llm.messages")
        self.pipes[s] = pipe

    @staticmethod
    def _docs(cands: list) -> list:
        from haystack import Document

        return [
            Document(id=i, content=text, meta={"title": title}, score=score)
            for i, title, text, score in map(_parts, cands)
        ]

    def _order(self, s: str, cands: list) -> list[str]:
        return [d.id for d in self.posts[s].run(self._docs(cands))["documents"]]

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        out = self.pipes[s].run(
            {
                "ranker": {"documents": self._docs(cands), "query": question},
                "prompt": {"query": question},
            }
        )
        [reply] = out["llm"]["replies"]
        return [d.id for d in out["ranker"]["documents"]], reply.text or ""


ENGINES = {e.framework: e for e in (_LlamaIndexEngines, _LangChainEngines, _HaystackEngines)}
"""The frameworks a pipeline sweep runs through (``--framework``)."""


def print_strategies(summary: dict, console: Console) -> None:
    """One row per curve: mean, worst (and its rank), best and the retrieval-weighted accuracy."""
    t = Table(title="strategies (x-axis: gold retrieval rank)", title_justify="left")
    for col in ("curve", "mean", "worst", "worst rank", "best", "retrieval-weighted"):
        t.add_column(col, justify="right" if col != "curve" else "left", overflow="fold")
    for label, c in summary["curves"].items():
        t.add_row(
            label,
            f"{c['mean']:.3f}",
            f"{c['worst']:.3f}",
            str(c["worst_position"]),
            f"{c['best']:.3f}",
            f"{summary['retrieval_weighted'].get(label, float('nan')):.3f}",
        )
    console.print(t)
