"""``ragfix eval`` (the position sweep), ``ragfix report`` and ``ragfix models``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ragfix.cli.common import (
    BackendOpt,
    BackendOptsOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    UserError,
    console,
    parse_options,
    user_errors,
)


def backend_options(
    opts: list[str] | None, calibration: Path | None, adapter: Path | None, train_window: int | None
) -> dict:
    """Merge ``--backend-opt key=value`` with the convenience flags of the method backends."""
    out = parse_options(opts)
    if calibration is not None:
        out["calibration"] = str(calibration)
    if adapter is not None:
        out["adapter"] = str(adapter)
    if train_window is not None:
        out["train_window"] = train_window
    return out


def run_eval(
    data: Path,
    out: Path,
    num_docs: int = 10,
    positions: str = "all",
    limit: int | None = None,
    model: str = "smollm2",
    backend: str = "vanilla",
    options: dict | None = None,
    distractor_pool: Path | None = None,
    skip_invalid: bool = False,
    prefix_reuse: bool = True,
    batch_size: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> dict:
    """The raw-model position sweep behind ``ragfix eval DATA``; returns the summary dict.

    Raises:
        DataError, ValueError, ConfigMismatchError, ModelNotFoundError: bad input (one line).
    """
    from ragfix.backends import backend_class, load_backend
    from ragfix.bundled import bundled_path
    from ragfix.errors import DataError
from ragfix.connectors.jsonl import SkipCounter
    from ragfix.connectors.litm import detect_format, load_samples
    from ragfix.eval.report import print_summary, progress_bar, write_report
    from ragfix.eval.shard import assign_groups, distributed_state, merge_shards
    from ragfix.eval.sweep import SweepConfig, open_store, parse_positions, plan_cells, run_cells
    from ragfix.models import resolve_device, resolve_model

    options = options or {}
    data = bundled_path(str(data)) or data
    if not data.exists():
        raise DataError(data, None, None, "file not found")
    backend_class(backend).options_model(**options)  # unknown backend / bad options: fail now
    resolve_model(model)  # unknown model / default not installed: fail before any work
    skipped = SkipCounter()
    samples = load_samples(data, num_docs, limit, distractor_pool, skip_invalid, skipped)
    if skipped.count:
        console.print(
            f"[yellow]skipped {skipped.count} invalid record(s)[/yellow]; "
            f"first: {skipped.examples[0]}",
            highlight=False,
        )
    pos = parse_positions(positions, num_docs)
    config = SweepConfig(
        data=str(data.resolve()),
        task=detect_format(data),
        num_docs=num_docs,
        model=model,
        backend=backend,
        backend_options=options,
        distractor_pool=str(distractor_pool.resolve()) if distractor_pool else None,
    )
    state = distributed_state()
    rank, world = (state.process_index, state.num_processes) if state else (0, 1)
    if state is not None:
        device = str(state.device)
    out.mkdir(parents=True, exist_ok=True)
    config.check_or_write(out)
    store = open_store(out, rank, world)
    done = store.load()
    cells = plan_cells(config, samples, pos)
    todo = [c for c in cells if c.cell_id not in done]
    if len(todo) < len(cells) and rank == 0:
        console.print(f"resuming: {len(cells) - len(todo)} of {len(cells)} cells already done")
    if world > 1:  # whole samples per rank, balanced by prompt length
        groups: dict[str, list] = {}
        for c in todo:
            groups.setdefault(c.sample.id, []).append(c)
        keys = sorted(groups)
        weights = [
            len(groups[k])
            * sum(len(p.text) + len(p.title) for p in groups[k][0].sample.distractors)
            for k in keys
        ]
        mine = assign_groups([groups[k] for k in keys], weights, keys, world)[rank]
        todo = [c for g in mine for c in g]
    if todo:
        b = load_backend(backend, model=model, device=device, dtype=dtype, **options)
        on_gpu = resolve_device(device).type == "cuda"
        bs = batch_size or (16 if on_gpu else 1)
        reuse = prefix_reuse and bs == 1
        right = [0]
        with progress_bar(console, disable=rank != 0) as bar:
            task = bar.add_task(f"{backend} sweep", total=len(todo), status="")

            def on_record(rec) -> None:
                if world > 1:
                    rec.extra["rank"] = rank
                store.append(rec.model_dump())
                right[0] += rec.correct
                n = bar.tasks[task].completed + 1
                bar.update(task, advance=1, status=f"acc {right[0] / n:.2f}")

            run_cells(b, todo, on_record, prefix_reuse=reuse, batch_size=bs)
    if state is not None:
        state.wait_for_everyone()
        if rank != 0:
            return {}
    merge_shards(out)
    records = open_store(out).load()
    mine = [records[c.cell_id] for c in cells if c.cell_id in records]
    summary = write_report(out, mine, {"skipped_records": skipped.count})
    print_summary(summary, console, title=f"{model} · {backend} · {num_docs} docs")
    console.print(
        f"results: {out / 'results.jsonl'} | summary: {out / 'summary.json'} | "
        f"plot: {out / 'curve.png'}"
    )
    return summary


def register(app: typer.Typer) -> None:
    """Add ``eval``, ``report`` and ``models`` to the CLI."""

    @app.command("eval")
    def eval_cmd(
        data: Annotated[
            Path | None,
            typer.Argument(
                help="Lost-in-the-Middle QA or KV-retrieval file (.jsonl, .jsonl.gz), "
                "or a bundled sample: nq-sample, kv-sample"
            ),
        ] = None,
        out: Annotated[Path, typer.Option("--out", "-o", help="run folder (resumable)")] = Path(
            "runs/eval"
        ),
        num_docs: Annotated[int, typer.Option(help="documents (or KV pairs) per prompt")] = 10,
        positions: Annotated[str, typer.Option(help="all | first,middle,last | 0,4,9")] = "all",
        limit: Annotated[int | None, typer.Option(help="use the first N samples")] = None,
        model: ModelOpt = "smollm2",
        backend: BackendOpt = "vanilla",
        backend_opt: BackendOptsOpt = None,
        calibration: Annotated[
            Path | None, typer.Option(help="channel-scaled: calibration JSON")
        ] = None,
        adapter: Annotated[Path | None, typer.Option(help="pos2distill: adapter folder")] = None,
        train_window: Annotated[
            int | None, typer.Option(help="gali: the model's trained window L (override)")
        ] = None,
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
            int | None, typer.Option(help="cells per batch (default 1 on CPU, 16 on CUDA)")
        ] = None,
        corpus: Annotated[
            Path | None, typer.Option(help="pipeline mode: a folder of documents")
        ] = None,
        questions: Annotated[
            Path | None, typer.Option(help="pipeline mode: questions JSONL")
        ] = None,
        strategy: Annotated[
            str, typer.Option(help="pipeline mode: reorder strategies, comma separated")
        ] = "none",
        profile: Annotated[
            Path | None, typer.Option(help="bias-profile strategy: a sweep's summary.json")
        ] = None,
        retriever: Annotated[str, typer.Option(help="pipeline mode: faiss or bm25")] = "faiss",
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """Accuracy as the gold passage moves through every position (table, summary.json,
        curve.png). With --corpus/--questions: the same sweep through a real LlamaIndex
        pipeline, one curve per reorder strategy."""
        with user_errors():
            options = backend_options(backend_opt, calibration, adapter, train_window)
            if corpus is not None or questions is not None:
                if corpus is None or questions is None:
                    raise UserError("pipeline mode needs both --corpus and --questions")
                from ragfix.eval.pipeline import run_pipeline_sweep

                run_pipeline_sweep(
                    corpus=corpus,
                    questions=questions,
                    out=out,
                    strategies=[s.strip() for s in strategy.split(",") if s.strip()],
                    top_k=num_docs,
                    positions=positions,
                    limit=limit,
                    model=model,
                    backend=backend,
                    backend_options=options,
                    profile=profile,
                    retriever=retriever,
                    skip_invalid=skip_invalid,
                    device=device,
                    dtype=dtype,
                    console=console,
                )
                return
            if data is None:
                raise UserError("give a data file (or --corpus and --questions)")
            run_eval(
                data,
                out,
                num_docs,
                positions,
                limit,
                model,
                backend,
                options,
                distractor_pool,
                skip_invalid,
                prefix_reuse,
                batch_size,
                device,
                dtype,
            )

    @app.command("demo")
    def demo_cmd(
        out: Annotated[Path, typer.Option("--out", "-o", help="run folder")] = Path("runs/demo"),
        limit: Annotated[int, typer.Option(help="samples")] = 6,
        device: DeviceOpt = "auto",
    ) -> None:
        """The lost-in-the-middle curve in ~3 minutes on a CPU: the embedded SmolLM2 on the
        bundled KV-retrieval sample (8 pairs, gold at every position)."""
        with user_errors():
            run_eval(Path("kv-sample"), out, num_docs=8, limit=limit, device=device)

    @app.command("report")
    def report_cmd(
        runs: Annotated[list[Path], typer.Argument(help="run folders (each with summary.json)")],
        out: Annotated[Path, typer.Option("--out", "-o", help="PNG to write")] = Path(
            "runs/compare.png"
        ),
        title: Annotated[str | None, typer.Option(help="plot title")] = None,
    ) -> None:
        """Print the tables of several runs and draw their curves on one plot.

        When there are two curves or more (several runs, or one run with several strategies),
        every curve is also compared with the first on the cells they share: the difference per
        position and the exact McNemar p-value."""
        from ragfix.eval.report import (
            SUMMARY_FILE,
            cells_by_curve,
            plot_curves,
            print_paired,
            print_summary,
        )
        from ragfix.eval.sweep import open_store

        with user_errors():
            loaded, curves = [], []
            for r in runs:
                folder = r if r.is_dir() else r.parent
                path = folder / SUMMARY_FILE
                if not path.exists():
                    raise UserError(f"{path}: no summary (run `ragfix eval ... --out {r}` first)")
                summary = json.loads(path.read_text())
                print_summary(summary, console, title=str(folder))
                loaded.append((folder.name, summary))
                records = list(open_store(folder).load().values())
                curves += [(f"{folder.name}:{k}", v) for k, v in cells_by_curve(records).items()]
            plot_curves(loaded, out, title)
            console.print(f"plot: {out}")
            if len(curves) > 1:
                print_paired(curves, console)

    @app.command("models")
    def models_cmd(
        prepare: Annotated[
            bool, typer.Option(help="convert the embedded default model now (once)")
        ] = True,
    ) -> None:
        """Show the installed and cached models; prepare the embedded default."""
        from ragfix.models import (
            ModelNotFoundError,
            ensure_converted,
            installed_models,
            smollm2_gguf_path,
        )

        with user_errors():
            if prepare:
                try:
                    with console.status("converting SmolLM2 GGUF to safetensors (once, ~20 s)"):
                        ensure_converted(smollm2_gguf_path())
                except ModelNotFoundError as e:
                    console.print(f"[yellow]{e}[/yellow]")
            t = Table(title="ragfix models")
            for col in ("name", "kind", "installed", "cached", "path / install command"):
                t.add_column(col)
            for row in installed_models():
                t.add_row(
                    row["name"],
                    row["kind"],
                    "yes" if row["installed"] else "no",
                    "yes" if row["cached"] else "no",
                    row["path"],
                )
            console.print(t)
