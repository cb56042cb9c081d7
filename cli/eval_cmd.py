"""``ragfix eval`` (the position sweep), ``ragfix demo`` and ``ragfix models``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import click
import typer
from rich.table import Table
from typer.core import TyperCommand

from ragfix.cli.common import (
    BACKEND_OPTIONS,
    ORDER_OPTIONS,
    REMOTE_OPTIONS,
    BaselineOpt,
    DeviceOpt,
    GateOpt,
    LimitOpt,
    LogPromptsOpt,
    PositionsOpt,
    RecordsOpt,
    ReferencesOpt,
    RepeatOpt,
    RestartOpt,
    RunFolderOpt,
    ShardOpt,
    SkipInvalidOpt,
    TaskOpt,
    apply_gates,
    backend_reference,
    console,
    gate_conditions,
    order_options,
    shard_finished,
    shard_value,
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


class EvalCommand(TyperCommand):
    """``ragfix eval``: an option of ``ragfix eval-pipeline`` that ``eval`` does not take (the
    pipeline sweep's ``--corpus``, ``--questions``, ``--framework`` ...) is refused in one line
    naming that command, before anything else is parsed."""

    #: the command that takes the pipeline sweep's options
    PIPELINE = "eval-pipeline"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Refuse an option of :attr:`PIPELINE` (``--opt`` or ``--opt=value``) that this command
        lacks, then parse as usual.

        Raises:
            typer.Exit: code 2, after ``error: ...`` on stderr (:func:`user_errors`).
        """
        group = ctx.parent.command if ctx.parent is not None else None
        pipeline = group.get_command(ctx.parent, self.PIPELINE) if group is not None else None
        if pipeline is not None:
            own = {o for p in self.params for o in (*p.opts, *p.secondary_opts)}
            theirs = {o for p in pipeline.params for o in (*p.opts, *p.secondary_opts)}
            for arg in args:
                if arg == "--":
                    break
                flag = arg.split("=", 1)[0]
                if flag.startswith("-") and flag in theirs - own:
                    with user_errors():
                        raise ConfigError(
                            f"{flag} is an option of ragfix {self.PIPELINE}, the sweep through a "
                            f"real pipeline over a corpus: run ragfix {self.PIPELINE} (ragfix "
                            "eval sweeps a data file)"
                        )
        return super().parse_args(ctx, args)


def register(app: typer.Typer) -> None:
    """Add ``eval``, ``demo`` and ``models`` to the CLI."""

    @app.command("eval", cls=EvalCommand)
    @REMOTE_OPTIONS
    @ORDER_OPTIONS
    @BACKEND_OPTIONS
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
        out: RunFolderOpt = Path("runs/eval"),
        num_docs: Annotated[int, typer.Option(help="documents (or KV pairs) per prompt")] = 10,
        positions: PositionsOpt = "all",
        task: TaskOpt = None,
        repeat: RepeatOpt = "none",
        references: ReferencesOpt = None,
        records: RecordsOpt = None,
        limit: LimitOpt = None,
        distractor_pool: Annotated[
            Path | None, typer.Option(help="file to draw distractors from (BM25)")
        ] = None,
        skip_invalid: SkipInvalidOpt = False,
        prefix_reuse: Annotated[
            bool, typer.Option(help="reuse the KV cache of the shared prompt prefix")
        ] = True,
        batch_size: Annotated[
            int | None,
            typer.Option(
                help="cells per batch (default 16 with prefix reuse or CUDA, else 1; 1 for a "
                "bf16 or fp16 model on the CPU)"
            ),
        ] = None,
        workers: Annotated[
            int | None,
            typer.Option(
                help="worker processes, each on whole samples (default on the CPU: one "
                "single-thread process per free core; $RAGFIX_WORKERS)"
            ),
        ] = None,
        restart: RestartOpt = False,
        log_prompts: LogPromptsOpt = True,
        gate: GateOpt = None,
        baseline: BaselineOpt = None,
        shard: ShardOpt = None,
        backend_flags: dict | None = None,
        remote: dict | None = None,
        order_flags: dict | None = None,
    ) -> None:
        """Accuracy as the gold passage moves through every position of a data file's prompts
        (table, summary.json, curve.png). Through a real pipeline over a corpus: ragfix
        eval-pipeline."""
        with user_errors():
            job = shard_value(shard, gate)
            conditions = gate_conditions(gate, baseline)
            ref = backend_reference(backend_flags, remote, order_options(order_flags or {}))
            if data is None:
                raise ConfigError(
                    "give a data file (the sweep through a pipeline over a corpus: ragfix "
                    "eval-pipeline)"
                )
            from ragfix.eval import run_sweep

            summary = run_sweep(
                data,
                out,
                backend=ref,
                task=task,
                repeat=repeat,
                references=references,
                num_docs=num_docs,
                positions=positions,
                records=records,
                limit=limit,
                batch_size=batch_size,
                prefix_reuse=prefix_reuse,
                skip_invalid=skip_invalid,
                distractor_pool=distractor_pool,
                workers=workers,
                restart=restart,
                log_prompts=log_prompts,
                shard=job,
                console=console,
            )
            if shard_finished(summary):
                return
            if summary:  # ranks other than 0 of a multi-process run report nothing
                print_run(summary, out, f"{ref.model} · {ref.name} · {num_docs} docs")
                if conditions:
                    apply_gates([*filter(None, [baseline]), out], conditions)

    @app.command("demo")
    def demo_cmd(
        out: Annotated[Path, typer.Option("--out", "-o", help="run folder")] = Path("runs/demo"),
        limit: Annotated[int, typer.Option(help="samples")] = 6,
        device: DeviceOpt = "auto",
    ) -> None:
        """Lost in the middle and its fix, in a few minutes on a CPU: the embedded SmolLM2 on
        the bundled KV-retrieval sample (8 pairs, the gold pair at every position), vanilla and
        the calibrated attention-sort on the same cells (OUT/vanilla, OUT/attention-sort), then
        both curves in one plot (OUT/curve.png) with the paired test per position (every number in
        OUT/comparison.json, as ``ragfix report --json`` writes it)."""
        from ragfix.eval import run_sweep
        from ragfix.eval.compare import (
            compare_loaded,
            comparison_tables,
            load_runs,
            write_comparison,
        )
        from ragfix.tables import print_tables

        with user_errors():
            folders = []
            for backend in ("vanilla", "attention-sort"):
                folder = out / backend
                summary = run_sweep(
                    "kv-sample",
                    folder,
                    num_docs=8,
                    limit=limit,
                    backend=backend,
                    device=device,
                    console=console,
                )
                print_run(summary, folder, f"smollm2 · {backend} · 8 KV pairs")
                folders.append(folder)
            plot = out / "curve.png"
            comparison = compare_loaded(
                load_runs(folders),
                plot=plot,
                title="smollm2 · 8 KV pairs · vanilla and attention-sort",
            )
            write_comparison(out / "comparison.json", comparison)
            print_tables(comparison_tables(comparison), console)
            console.print(f"plot: {plot}", soft_wrap=True, highlight=False)

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
        from ragfix.models.device import auto_dtype_line
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
            console.print(auto_dtype_line(), highlight=False, soft_wrap=True)
