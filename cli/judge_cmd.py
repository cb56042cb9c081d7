"""``ragfix judge``: an LLM judge's position bias on pairwise data, and order-free verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import (
    BACKEND_OPTIONS,
    REMOTE_OPTIONS,
    RestartOpt,
    ShardOpt,
    backend_reference,
    console,
    shard_finished,
    shard_value,
    user_errors,
)
from ragfix.errors import ConfigError


def _print_result(result, warn_unparsed: bool = True) -> None:
    """The tables of a judge run (rendered from its ``summary.json``), a warning when most
    generated verdicts were unreadable, and the paths of the run folder's files."""
    import json

    from ragfix.judge import print_judge_summary

    print_judge_summary(json.loads(result.files["summary"].read_text()), console)
    for s in result.summaries.values():
        inv = s["generated"]["invalid_rate"]
        if warn_unparsed and inv is not None and inv > 0.5:
            console.print(
                f"[yellow]{inv:.0%} of the generated verdicts could not be parsed[/yellow]; "
                "the logit verdict (--style verdict) does not depend on parsing"
            )
    for note in result.notes:
        console.print(f"[yellow]{note}[/yellow]", highlight=False)
    console.print(" | ".join(f"{k}: {v}" for k, v in result.files.items()), highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``judge`` to the CLI."""

    @app.command("judge")
    @REMOTE_OPTIONS
    @BACKEND_OPTIONS
    def judge_cmd(
        data: Annotated[
            Path,
            typer.Argument(
                help="pairs (LLMBar, PandaLM, MT-bench answers, KV-retrieval records, or JSONL "
                "with question, answer_a, answer_b, label), or LLMBar swap judgments of other "
                "judges"
            ),
        ],
        out: Annotated[Path, typer.Option("--out", "-o", help="run folder (resumable)")] = Path(
            "runs/judge"
        ),
        limit: Annotated[int | None, typer.Option(help="use the first N pairs")] = None,
        repeats: Annotated[
            int, typer.Option(help="sampled verdicts per order, for repetition stability")
        ] = 1,
        style: Annotated[
            str,
            typer.Option(
                help="verdict: verdict only, prefilled '[[' (logit verdict); explain: MT-bench"
            ),
        ] = "verdict",
        max_new_tokens: Annotated[
            int | None, typer.Option(help="generation budget (default 4 verdict, 256 explain)")
        ] = None,
        tie_margin: Annotated[
            float, typer.Option(help="logit verdict: tie when |p(a) - p(b)| <= margin")
        ] = 0.0,
        swap: Annotated[
            str,
            typer.Option(
                help="the second order: relabel (MT-bench: answers swap places and labels) or "
                "move (the answer blocks swap places, labels travel with them)"
            ),
        ] = "relabel",
        labels: Annotated[
            str,
            typer.Option(
                help="slot: the first slot is assistant A (MT-bench); content: each answer's "
                "letter follows from its text, the same in both orders"
            ),
        ] = "slot",
        calibrate: Annotated[
            str,
            typer.Option(
                help="none, or content-free: divide the letter probabilities by the judge's "
                "prior on content-free inputs (Zhao et al. 2021)"
            ),
        ] = "none",
        records: Annotated[
            str | None,
            typer.Option(help="judge the records START:END of the file (0-based, END excluded)"),
        ] = None,
        batch_size: Annotated[
            int | None,
            typer.Option(
                help="prompts per batch (default 4 on CPU, 32 on CUDA; 1 for a bf16 or fp16 "
                "model on the CPU)"
            ),
        ] = None,
        mtbench_models: Annotated[
            str, typer.Option(help="MT-bench answers: the two models to compare, comma separated")
        ] = "gpt-4,gpt-3.5-turbo",
        kv_wrong: Annotated[
            str,
            typer.Option(
                help="KV-retrieval records: the wrong answer is another given pair's value "
                "(context) or a value no given pair holds (unsupported)"
            ),
        ] = "context",
        from_judgments: Annotated[
            bool,
            typer.Option(help="DATA holds other judges' verdicts: compute the metrics only"),
        ] = False,
        skip_invalid: Annotated[
            bool, typer.Option(help="skip and count malformed records instead of stopping")
        ] = False,
        restart: RestartOpt = False,
        shard: ShardOpt = None,
        backend_flags: dict | None = None,
        remote: dict | None = None,
    ) -> None:
        """Judge pairs in both orders: position consistency, preference fairness, first-slot
        win rate, agreement with human labels for single-order, swap-aggregated and logit
        verdicts (table, judgments.jsonl, summary.json, judge.png)."""
        from ragfix.eval.judge_run import run_judge, summarize_judgments

        with user_errors():
            job = shard_value(shard)
            if from_judgments:
                if job is not None:
                    raise ConfigError("--from-judgments computes metrics only: no --shard")
                _print_result(summarize_judgments(data, out, limit), warn_unparsed=False)
                return
            result = run_judge(
                data,
                out,
                backend=backend_reference(backend_flags, remote),
                style=style,
                limit=limit,
                repeats=repeats,
                max_new_tokens=max_new_tokens,
                tie_margin=tie_margin,
                swap=swap,
                labels=labels,
                calibrate=calibrate,
                records=records,
                batch_size=batch_size,
                mtbench_models=tuple(m.strip() for m in mtbench_models.split(",") if m.strip()),
                kv_wrong=kv_wrong,
                skip_invalid=skip_invalid,
                restart=restart,
                shard=job,
                console=console,
            )
            if not shard_finished(result):
                _print_result(result)
