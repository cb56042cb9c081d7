"""``ragfix eval`` (the position sweep), ``ragfix demo`` and ``ragfix models``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ragfix.cli.common import (
    ORDER_OPTIONS,
    REMOTE_OPTIONS,
    AdapterOpt,
    BackendOpt,
    BackendOptsOpt,
    CalibrationOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    RestartOpt,
    TrainWindowOpt,
    backend_options,
    console,
    order_options,
    remote_options,
    user_errors,
)
from ragfix.errors import ConfigError


def print_run(summary: dict, out: Path, title: str) -> None:
    """The per-position tables of a finished sweep, its flagged cells per position (overflow,
    degenerate gold) and where its files are."""
    from ragfix.eval.sweep_summary import print_flags, print_run_files, print_summary

    print_summary(summary, console, title=title)
    print_flags(summary, console)
    print_run_files(out, console)


def register(app: typer.Typer) -> None:
    """Add ``eval``, ``demo`` and ``models`` to the CLI."""

    @app.command("eval")
    @REMOTE_OPTIONS
    @ORDER_OPTIONS
    def eval_cmd(
        data: Annotated[
            Path | None,
            typer.Argument(
                help="Lost-in-the-Middle QA or KV-retrieval file, JSON Lines (.jsonl, .jsonl.gz), "
                "one record a line: QA reads question, answers, ctxs (title, text, isgold); KV "
                "reads ordered_kv_records ([key, value] pairs), key, value. Or a bundled sample: "
                "nq-sample, kv-sample"
            ),
        ] = None,
        out: Annotated[Path, typer.Option("--out", "-o", help="run folder (resumable)")] = Path(
            "runs/eval"
        ),
        num_docs: Annotated[int, typer.Option(help="documents (or KV pairs) per prompt")] = 10,
        positions: Annotated[str, typer.Option(help="all | first,middle,last | 0,4,9")] = "all",
        records: Annotated[
            str | None,
            typer.Option(
                help="record range START:END of the data file (0-based, END excluded; record i "
                "is line i+1), before --limit; kept in config.json"
            ),
        ] = None,
        limit: Annotated[int | None, typer.Option(help="use the first N samples")] = None,
        model: ModelOpt = "smollm2",
        backend: BackendOpt = "vanilla",
        backend_opt: BackendOptsOpt = None,
        calibration: CalibrationOpt = None,
        adapter: AdapterOpt = None,
        train_window: TrainWindowOpt = None,
        distractor_pool: Annotated[
            Path | None, typer.Option(help="file to draw distractors from (BM25)")
        ] = None,
        skip_invalid: Annotated[
            bool, typer.Option(help="skip and count malformed records instead of stopping")
        ] = False,
        prefix_reuse: Annotated[
            bool, typer.Option(help="reuse the KV cache of the shared prompt prefix")
        ] = True,
        batch_size: Annotated[
            int | None,
            typer.Option(help="cells per batch (default 16 with prefix reuse or CUDA, else 1)"),
        ] = None,
        workers: Annotated[
            int | None,
            typer.Option(
                help="worker processes, each on whole samples (default on the CPU: one "
                "single-thread process per free core; $RAGFIX_WORKERS)"
            ),
        ] = None,
        corpus: Annotated[
            Path | None,
            typer.Option(
                help="pipeline mode: a folder of documents (or a JSONL corpus; demo: the bundled "
                "NQ passages); never written: its index lives in the ragfix cache"
            ),
        ] = None,
        questions: Annotated[
            Path | None,
            typer.Option(help="pipeline mode: questions JSONL (question, answers, gold_text)"),
        ] = None,
        needles: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="pipeline mode, no question file: plant N facts in N chunks of the corpus "
                "and ask each",
            ),
        ] = None,
        needle_seed: Annotated[
            int, typer.Option(help="--needles: seed of the chunks, facts and insertion points")
        ] = 0,
        questions_from: Annotated[
            str | None,
            typer.Option(
                help="pipeline mode, no question file: a model (smollm2, HF id, folder, "
                "openai:NAME with --api-base) writes a question per sampled chunk; kept in the "
                "run folder's questions.jsonl"
            ),
        ] = None,
        question_chunks: Annotated[
            int, typer.Option(min=1, help="--questions-from: chunks sampled, one question each")
        ] = 20,
        question_seed: Annotated[
            int, typer.Option(help="--questions-from: seed of the sampled chunks")
        ] = 0,
        chunk_size: Annotated[
            int | None,
            typer.Option(min=1, help="pipeline mode: chunk size in embedder tokens (default 64)"),
        ] = None,
        embedder: Annotated[
            str | None,
            typer.Option(
                help="pipeline mode: sentence-transformers model id or folder (default: the "
                "embedded all-MiniLM-L6-v2)"
            ),
        ] = None,
        strategy: Annotated[
            str, typer.Option(help="pipeline mode: reorder strategies, comma separated")
        ] = "none",
        profile: Annotated[
            Path | None, typer.Option(help="bias-profile strategy: a sweep's summary.json")
        ] = None,
        retriever: Annotated[str, typer.Option(help="pipeline mode: faiss or bm25")] = "faiss",
        framework: Annotated[
            str,
            typer.Option(
                help="pipeline mode: llamaindex, langchain or haystack (the last two need "
                'pip install "ragfix[langchain]" / "ragfix[haystack]")'
            ),
        ] = "llamaindex",
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
        restart: RestartOpt = False,
        log_prompts: Annotated[
            bool,
            typer.Option(
                help="keep in results.jsonl the prompt each cell's model read (shown by ragfix "
                "report --html); --no-log-prompts leaves them out of a very large run. A folder "
                "keeps the setting it was started with"
            ),
        ] = True,
        remote: dict | None = None,
        order_flags: dict | None = None,
    ) -> None:
        """Accuracy as the gold passage moves through every position (table, summary.json,
        curve.png). With --corpus: the same sweep through a real LlamaIndex, LangChain or
        Haystack pipeline (--framework), one curve per reorder strategy, on --questions, on
        --needles planted in the corpus or on questions --questions-from a model writes."""
        with user_errors():
            from ragfix.models.resolve import REMOTE_PREFIX

            writer_remote = questions_from is not None and questions_from.startswith(REMOTE_PREFIX)
            answer_remote = model.startswith(REMOTE_PREFIX) or not writer_remote
            options = {
                **backend_options(backend_opt, calibration, train_window),
                **remote_options(model, remote if answer_remote else {}),
            }
            writer = remote_options(questions_from, remote) if writer_remote else {}
            orders = order_options(order_flags or {})
            pipeline = (questions, needles, questions_from)
            if corpus is not None or any(x is not None for x in pipeline):
                if corpus is None:
                    raise ConfigError("pipeline mode needs --corpus")
                if records is not None:
                    raise ConfigError("--records selects records of a data file, not questions")
                if workers is not None:
                    raise ConfigError("--workers splits a data file's samples, not pipeline mode")
                if orders is not None:
                    raise ConfigError(
                        "--orders needs the passages of each prompt, which a framework's "
                        "rendered prompt does not mark: use it with a data file"
                    )
                from ragfix.connectors.synthetic import NeedleSettings, QuestionsFrom
                from ragfix.eval.pipeline import print_pipeline_run, run_pipeline_sweep

                summary = run_pipeline_sweep(
                    corpus=corpus,
                    questions=questions,
                    out=out,
                    strategies=[s.strip() for s in strategy.split(",") if s.strip()],
                    top_k=num_docs,
                    positions=positions,
                    limit=limit,
                    model=model,
                    backend=backend,
                    adapter=adapter,
                    backend_options=options,
                    profile=profile,
                    retriever=retriever,
                    framework=framework,
                    skip_invalid=skip_invalid,
                    device=device,
                    dtype=dtype,
                    restart=restart,
                    log_prompts=log_prompts,
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
                    **({} if chunk_size is None else {"chunk_size": chunk_size}),
                )
                print_pipeline_run(summary, out, console)
                return
            if data is None:
                raise ConfigError("give a data file (or --corpus and a source of questions)")
            from ragfix.eval import run_sweep

            summary = run_sweep(
                data,
                out,
                model=model,
                backend=backend,
                adapter=adapter,
                backend_options=options,
                orders=None if orders is None else orders.model_dump(),
                num_docs=num_docs,
                positions=positions,
                records=records,
                limit=limit,
                batch_size=batch_size,
                prefix_reuse=prefix_reuse,
                skip_invalid=skip_invalid,
                distractor_pool=distractor_pool,
                workers=workers,
                device=device,
                dtype=dtype,
                restart=restart,
                log_prompts=log_prompts,
                console=console,
            )
            if summary:  # ranks other than 0 of a multi-process run report nothing
                print_run(summary, out, f"{model} · {backend} · {num_docs} docs")

    @app.command("demo")
    def demo_cmd(
        out: Annotated[Path, typer.Option("--out", "-o", help="run folder")] = Path("runs/demo"),
        limit: Annotated[int, typer.Option(help="samples")] = 6,
        device: DeviceOpt = "auto",
    ) -> None:
        """The lost-in-the-middle curve in a few minutes on a CPU: the embedded SmolLM2 on the
        bundled KV-retrieval sample (8 pairs, gold at every position)."""
        from ragfix.eval import run_sweep

        with user_errors():
            summary = run_sweep(
                "kv-sample", out, num_docs=8, limit=limit, device=device, console=console
            )
            print_run(summary, out, "smollm2 · vanilla · 8 KV pairs")

    def show_model_check(name: str) -> None:
        from ragfix.eval.families import check_model

        family, verdicts = check_model(name)
        windows = sorted({w for w in family.windows if w is not None})
        console.print(
            f"{name}: {family.name}, {len(family.windows)} layers"
            + (
                f", sliding window {windows} on {sum(w is not None for w in family.windows)}"
                if windows
                else ""
            )
            + (", fused qkv" if family.fused_qkv else "")
            + (f", partial rotary {family.partial_rotary}" if family.partial_rotary < 1 else ""),
            highlight=False,
            soft_wrap=True,
        )
        t = Table(title=f"backends on {name}")
        for col in ("backend", "supported", "why not"):
            t.add_column(col, overflow="fold")
        for backend, refusal in verdicts:
            t.add_row(backend, "no" if refusal else "yes", refusal or "")
        console.print(t)

    @app.command("models")
    def models_cmd(
        prepare: Annotated[
            bool, typer.Option(help="convert the embedded default model now (once)")
        ] = True,
        check: Annotated[
            str | None,
            typer.Option(
                help="a model (hub id, folder, .gguf): which backends it supports and why not, "
                "read from its config (no weights loaded)"
            ),
        ] = None,
    ) -> None:
        """Show the installed and cached models; prepare the embedded default. With --check
        MODEL: the backends that model's family supports, and the reason for each refusal."""
        from ragfix.errors import ModelNotFoundError
        from ragfix.models.gguf import ensure_converted
        from ragfix.models.resolve import installed_models, smollm2_gguf_path

        if check is not None:
            with user_errors():
                show_model_check(check)
            return
        with user_errors():
            if prepare:
                try:
                    with console.status("converting SmolLM2 GGUF to safetensors (once, ~20 s)"):
                        ensure_converted(smollm2_gguf_path())
                except ModelNotFoundError as e:
                    console.print(f"[yellow]{e}[/yellow]")
            rows = installed_models()
            t = Table(title="ragfix models")
            for col in ("#", "name", "kind", "installed", "cached"):
                t.add_column(col, overflow="fold")
            for i, row in enumerate(rows, 1):
                yes_no = ["yes" if row[k] else "no" for k in ("installed", "cached")]
                t.add_row(str(i), row["name"], row["kind"], *yes_no)
            console.print(t)
            for i, row in enumerate(rows, 1):  # whole paths, never cut to the terminal's width
                console.print(f"{i}. {row['path']}", highlight=False, soft_wrap=True)
