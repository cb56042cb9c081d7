"""``ragfix judge``: an LLM judge's position bias on pairwise data, and order-free verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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

JUDGMENTS_FILE = "judgments.jsonl"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "judge.png"
CONFIG_FILE = "config.json"


def _check_config(out: Path, config: dict) -> None:
    """Write ``out/config.json`` or check that a resumed run uses the same settings.

    Raises:
        UserError: the folder holds judgments made with other settings.
    """
    import json

    from ragfix.io import atomic_write_json

    path = out / CONFIG_FILE
    if path.exists():
        theirs = json.loads(path.read_text())
        diff = [k for k in config if theirs.get(k) != config[k]]
        if diff:
            detail = "; ".join(f"{k}: {theirs.get(k)!r} there, {config[k]!r} now" for k in diff)
            raise UserError(
                f"{out} holds judgments made with other settings ({detail}); use another --out"
            )
        return
    atomic_write_json(path, config)


def _write(out: Path, summaries: dict[str, dict], extra: dict, title: str) -> None:
    from ragfix.io import atomic_write_json
    from ragfix.judge import plot_judges, print_judge_summary

    atomic_write_json(out / SUMMARY_FILE, {**extra, "judges": summaries})
    plot_judges(summaries, out / PLOT_FILE, title)
    print_judge_summary(summaries, console)


def summarize_judgments_file(data: Path, out: Path, limit: int | None = None) -> dict:
    """Metrics of the verdicts other judges gave in both orders (LLMBar swap judgments), per
    judge: table, ``summary.json`` and ``judge.png`` in ``out``; returns the summaries."""
    from ragfix.connectors.pairwise import load_swap_judgments
    from ragfix.judge import summarize_swap_judgments

    per_judge = load_swap_judgments(data, limit)
    summaries = {ev: summarize_swap_judgments(rows) for ev, rows in per_judge.items()}
    out.mkdir(parents=True, exist_ok=True)
    _write(out, summaries, {"data": str(data), "limit": limit}, f"{data.name}: swap judgments")
    console.print(f"summary: {out / SUMMARY_FILE} | plot: {out / PLOT_FILE}")
    return summaries


def run_judge(
    data: Path,
    out: Path,
    model: str = "smollm2",
    backend: str = "vanilla",
    options: dict | None = None,
    limit: int | None = None,
    repeats: int = 1,
    style: str = "verdict",
    max_new_tokens: int | None = None,
    tie_margin: float = 0.0,
    batch_size: int | None = None,
    mtbench_models: tuple[str, str] = ("gpt-4", "gpt-3.5-turbo"),
    skip_invalid: bool = False,
    device: str = "auto",
    dtype: str = "auto",
) -> dict:
    """Judge every pair of ``data`` in both orders with ``backend``, resumably; write
    ``judgments.jsonl``, ``summary.json`` and ``judge.png`` into ``out``; returns the summary.

    Raises:
        DataError, UserError, ValueError, ModelNotFoundError: bad input (one line).
    """
    from ragfix.backends import backend_class, load_backend
    from ragfix.connectors.jsonl import SkipCounter
    from ragfix.connectors.pairwise import detect_format, load_pairs
    from ragfix.eval.report import progress_bar
    from ragfix.io import JsonlStore
    from ragfix.judge import PairwiseJudge, summarize
    from ragfix.models import resolve_device, resolve_model

    options = options or {}
    fmt = detect_format(data)
    if fmt == "swap_judgments":
        return summarize_judgments_file(data, out, limit)
    backend_class(backend).options_model(**options)
    resolve_model(model)
    skipped = SkipCounter()
    pairs = load_pairs(data, limit, skip_invalid, skipped, mtbench_models)
    if skipped.count:
        console.print(
            f"[yellow]skipped {skipped.count} invalid record(s)[/yellow]; "
            f"first: {skipped.examples[0]}",
            highlight=False,
        )
    if not pairs:
        raise UserError(f"{data}: no pairs to judge")
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "data": str(data.resolve()),
        "format": fmt,
        "model": model,
        "backend": backend,
        "backend_options": options,
        "style": style,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "tie_margin": tie_margin,
        "mtbench_models": list(mtbench_models) if fmt == "mtbench" else None,
    }
    _check_config(out, config)
    store = JsonlStore(out / JUDGMENTS_FILE, key="pair_id")
    done = store.load()
    todo = [p for p in pairs if p.pair_id not in done]
    if len(todo) < len(pairs):
        console.print(f"resuming: {len(pairs) - len(todo)} of {len(pairs)} pairs already judged")
    if todo:
        b = load_backend(backend, model=model, device=device, dtype=dtype, **options)
        on_gpu = resolve_device(device).type == "cuda"
        judge = PairwiseJudge(
            b,
            style=style,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            tie_margin=tie_margin,
            batch_size=batch_size or (32 if on_gpu else 4),
        )
        counts = {"consistent": 0, "first": 0, "n": 0}
        with progress_bar(console) as bar:
            task = bar.add_task(f"judging ({backend})", total=len(todo), status="")

            def on_result(res) -> None:
                store.append(res.model_dump(mode="json"))
                counts["n"] += 1
                counts["consistent"] += res.consistent
                bar.update(
                    task,
                    advance=1,
                    status=f"consistent {counts['consistent'] / counts['n']:.2f}",
                )

            judge.judge_pairs(todo, on_result)
    records = store.load()
    mine = [records[p.pair_id] for p in pairs if p.pair_id in records]
    name = f"{model} · {backend}"
    summary = summarize(mine)
    extra = {"config": config, "skipped_records": skipped.count, "torn_lines": store.torn_lines}
    _write(out, {name: summary}, extra, f"{data.name}: {name} as judge ({style})")
    inv = summary["generated"]["invalid_rate"]
    if inv is not None and inv > 0.5:
        console.print(
            f"[yellow]{inv:.0%} of the generated verdicts could not be parsed[/yellow]; "
            "the logit verdict (--style verdict) does not depend on parsing"
        )
    console.print(
        f"judgments: {out / JUDGMENTS_FILE} | summary: {out / SUMMARY_FILE} | "
        f"plot: {out / PLOT_FILE}"
    )
    return summary


def register(app: typer.Typer) -> None:
    """Add ``judge`` to the CLI."""

    @app.command("judge")
    def judge_cmd(
        data: Annotated[
            Path,
            typer.Argument(
                help="pairs (LLMBar, PandaLM, MT-bench answers, or JSONL with question, "
                "answer_a, answer_b, label), or LLMBar swap judgments of other judges"
            ),
        ],
        out: Annotated[Path, typer.Option("--out", "-o", help="run folder (resumable)")] = Path(
            "runs/judge"
        ),
        model: ModelOpt = "smollm2",
        backend: BackendOpt = "vanilla",
        backend_opt: BackendOptsOpt = None,
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
        batch_size: Annotated[
            int | None, typer.Option(help="prompts per batch (default 4 on CPU, 32 on CUDA)")
        ] = None,
        mtbench_models: Annotated[
            str, typer.Option(help="MT-bench answers: the two models to compare, comma separated")
        ] = "gpt-4,gpt-3.5-turbo",
        from_judgments: Annotated[
            bool,
            typer.Option(help="DATA holds other judges' verdicts: compute the metrics only"),
        ] = False,
        skip_invalid: Annotated[
            bool, typer.Option(help="skip and count malformed records instead of stopping")
        ] = False,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """Judge pairs in both orders: position consistency, preference fairness, first-slot
        win rate, agreement with human labels for single-order, swap-aggregated and logit
        verdicts (table, judgments.jsonl, summary.json, judge.png)."""
        with user_errors():
            if from_judgments:
                summarize_judgments_file(data, out, limit)
                return
            models = tuple(m.strip() for m in mtbench_models.split(",") if m.strip())
            if len(models) != 2:
                raise UserError("--mtbench-models needs two model names, comma separated")
            run_judge(
                data,
                out,
                model,
                backend,
                parse_options(backend_opt),
                limit,
                repeats,
                style,
                max_new_tokens,
                tie_margin,
                batch_size,
                models,  # type: ignore[arg-type]
                skip_invalid,
                device,
                dtype,
            )
