"""``ragfix eval-pipeline``: the position sweep through a real LlamaIndex, LangChain or Haystack
pipeline (:func:`ragfix.eval.pipeline.run_pipeline_sweep`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ragfix.cli.common import (
    BACKEND_OPTIONS,
    ORDER_OPTIONS,
    REMOTE_OPTIONS,
    BaselineOpt,
    GateOpt,
    LimitOpt,
    LogPromptsOpt,
    QaTaskOpt,
    RanksOpt,
    RecordsOpt,
    RepeatOpt,
    RestartOpt,
    RunFolderOpt,
    ShardOpt,
    SkipInvalidOpt,
    apply_gates,
    backend_reference,
    console,
    gate_conditions,
    order_options,
    remote_options,
    shard_finished,
    shard_value,
    user_errors,
)


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


def print_pipeline_run(summary: dict, out: Path, console: Console) -> None:
    """What ``ragfix eval-pipeline`` prints for a finished pipeline sweep: what the filter of
    written questions dropped, the per-rank tables, the flagged cells, the strategies and where
    the files are."""
    from ragfix.connectors.corpus import describe_copies
    from ragfix.connectors.questions import WRITTEN_QUESTIONS
    from ragfix.eval.sweep_summary import print_flags, print_run_files, print_summary

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


def register(app: typer.Typer) -> None:
    """Add ``eval-pipeline`` to the CLI."""

    @app.command("eval-pipeline")
    @REMOTE_OPTIONS
    @ORDER_OPTIONS
    @BACKEND_OPTIONS
    def eval_pipeline_cmd(
        corpus: Annotated[
            Path,
            typer.Option(
                help="a folder of documents (or a JSONL corpus; demo: the bundled NQ passages); "
                "never written: its index lives in the ragfix cache"
            ),
        ],
        questions: Annotated[
            Path | None,
            typer.Option(
                help="questions JSONL (question, answers, gold_text; demo: the bundled NQ "
                "questions)"
            ),
        ] = None,
        needles: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="no question file: plant N facts in N chunks of the corpus and ask each",
            ),
        ] = None,
        needle_seed: Annotated[
            int, typer.Option(help="--needles: seed of the chunks, facts and insertion points")
        ] = 0,
        questions_from: Annotated[
            str | None,
            typer.Option(
                help="no question file: a model (smollm2, HF id, folder, openai:NAME with "
                "--api-base) writes a question per sampled chunk; kept in the run folder's "
                "questions.jsonl"
            ),
        ] = None,
        question_chunks: Annotated[
            int, typer.Option(min=1, help="--questions-from: chunks sampled, one question each")
        ] = 20,
        question_seed: Annotated[
            int, typer.Option(help="--questions-from: seed of the sampled chunks")
        ] = 0,
        out: RunFolderOpt = Path("runs/eval-pipeline"),
        num_docs: Annotated[
            int, typer.Option(help="chunks the retriever returns (the documents in the prompt)")
        ] = 10,
        positions: RanksOpt = "all",
        records: RecordsOpt = None,
        limit: LimitOpt = None,
        strategy: Annotated[str, typer.Option(help="reorder strategies, comma separated")] = "none",
        profile: Annotated[
            Path | None, typer.Option(help="bias-profile strategy: a sweep's summary.json")
        ] = None,
        retriever: Annotated[str, typer.Option(help="faiss or bm25")] = "faiss",
        framework: Annotated[
            str,
            typer.Option(
                help="llamaindex, langchain or haystack (the last two need pip install "
                '"ragfix[langchain]" / "ragfix[haystack]")'
            ),
        ] = "llamaindex",
        chunk_size: Annotated[
            int | None, typer.Option(min=1, help="chunk size in embedder tokens (default 64)")
        ] = None,
        embedder: Annotated[
            str | None,
            typer.Option(
                help="sentence-transformers model id or folder (default: the embedded "
                "all-MiniLM-L6-v2)"
            ),
        ] = None,
        skip_invalid: SkipInvalidOpt = False,
        restart: RestartOpt = False,
        log_prompts: LogPromptsOpt = True,
        task: QaTaskOpt = "qa",
        repeat: RepeatOpt = "none",
        gate: GateOpt = None,
        baseline: BaselineOpt = None,
        shard: ShardOpt = None,
        backend_flags: dict | None = None,
        remote: dict | None = None,
        order_flags: dict | None = None,
    ) -> None:
        """The position sweep through a real LlamaIndex, LangChain or Haystack pipeline
        (--framework): the gold chunk at every retrieval rank, one curve per reorder strategy,
        on --questions, on --needles planted in the corpus or on questions --questions-from a
        model writes (table, summary.json, curve.png)."""
        with user_errors():
            job = shard_value(shard, gate)
            conditions = gate_conditions(gate, baseline)
            from ragfix.connectors.synthetic import NeedleSettings, QuestionsFrom
            from ragfix.eval.pipeline import run_pipeline_sweep
            from ragfix.models.resolve import REMOTE_PREFIX

            writer_remote = questions_from is not None and questions_from.startswith(REMOTE_PREFIX)
            answer_remote = backend_flags["model"].startswith(REMOTE_PREFIX) or not writer_remote
            ref = backend_reference(
                backend_flags, remote if answer_remote else {}, order_options(order_flags or {})
            )
            writer = remote_options(questions_from, remote) if writer_remote else {}
            summary = run_pipeline_sweep(
                corpus=corpus,
                questions=questions,
                out=out,
                strategies=[s.strip() for s in strategy.split(",") if s.strip()],
                top_k=num_docs,
                positions=positions,
                limit=limit,
                records=records,
                backend=ref,
                profile=profile,
                retriever=retriever,
                framework=framework,
                skip_invalid=skip_invalid,
                restart=restart,
                log_prompts=log_prompts,
                shard=job,
                console=console,
                needles=None
                if needles is None
                else NeedleSettings(count=needles, seed=needle_seed),
                questions_from=None
                if questions_from is None
                else QuestionsFrom(
                    model=questions_from, chunks=question_chunks, seed=question_seed
                ),
                writer_options=writer,
                embedder=embedder,
                task=task,
                repeat=repeat,
                **({} if chunk_size is None else {"chunk_size": chunk_size}),
            )
            if shard_finished(summary):
                return
            print_pipeline_run(summary, out, console)
            if conditions:
                apply_gates([*filter(None, [baseline]), out], conditions)
