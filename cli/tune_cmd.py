"""``ragfix tune``: choose a training-free method's defaults on a tune range of records."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    TaskOpt,
    console,
    show_tables,
    user_errors,
)

tune = typer.Typer(
    help="Choose a method's defaults on a tune range (disjoint from your test range)."
)


@tune.command("attention-sort")
def attention_sort_cmd(
    data: Annotated[
        str, typer.Argument(help="Lost-in-the-Middle QA or KV file, or a bundled sample")
    ],
    records: Annotated[
        str, typer.Option(help="the tune range START:END of the data file (0-based, END excluded)")
    ] = "0:30",
    num_docs: Annotated[int, typer.Option(help="documents (or KV pairs) per prompt")] = 8,
    positions: Annotated[str, typer.Option(help="all | first,middle,last | 0,4,9")] = "all",
    task: TaskOpt = None,
    model: ModelOpt = "smollm2",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    rounds: Annotated[
        int,
        typer.Option(
            min=1,
            help="then sort every cell this many rounds with the default variant: how often "
            "the gold passage is placed after each round (a second table)",
        ),
    ] = 1,
    place: Annotated[
        str | None,
        typer.Option(help="--rounds: last or first (default: the model's)"),
    ] = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="keep the table as a result file (results/NAME.json)"),
    ] = None,
) -> None:
    """How often each attention-sort variant (layers x calibrate) scores the gold passage
    highest, per gold position: the default is the variant with the best worst position; with
    --rounds, how often the default variant places the gold passage after each round."""
    from ragfix.backends import load_backend
    from ragfix.backends.attention_sort.options import AttentionSortOptions
    from ragfix.backends.attention_sort.tune import (
        VARIANTS,
        tune_attention_sort,
        tune_rounds,
        variant_name,
    )
    from ragfix.bundled import resolve_data
    from ragfix.connectors.litm import detect_format, load_samples
    from ragfix.eval.progress import progress_bar
    from ragfix.eval.sweep import parse_positions
    from ragfix.tasks import resolve_task

    with user_errors():
        pos = parse_positions(positions, num_docs)
        sort = AttentionSortOptions(rounds=rounds, place=place)  # validated before any load
        path = resolve_data(data)
        task = resolve_task(task, "none", detect_format(path), reads_passages=True).name
        samples = load_samples(path, num_docs, records=records, task=task)
        backend = load_backend("vanilla", model=model, device=device, dtype=dtype)
        with progress_bar(console) as bar:
            shown = bar.add_task("tune attention-sort", total=len(samples) * len(pos), status="")
            table, details = tune_attention_sort(
                backend, samples, pos, lambda done, total: bar.update(shown, completed=done)
            )
            tables = [table]
            if rounds > 1:
                best = next(v for v in VARIANTS if variant_name(v) == details["default"])
                sort = best.model_copy(update={"rounds": rounds, "place": sort.place})
                shown = bar.add_task("rounds", total=len(samples) * len(pos), status="")
                table, details["rounds"] = tune_rounds(
                    backend,
                    samples,
                    pos,
                    sort,
                    lambda done, total: bar.update(shown, completed=done),
                )
                tables.append(table)
        details |= {"data": str(data), "records": records, "num_docs": num_docs, "task": task}
    show_tables(tables, details, json_out, keep_all=True)


@tune.command("orders")
def orders_cmd(
    run: Annotated[
        Path,
        typer.Argument(
            help="a finished sweep of the tune range made with --orders K (the largest)"
        ),
    ],
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help="keep the table as a result file (results/NAME.json)"),
    ] = None,
) -> None:
    """Accuracy per gold position of every number of orders up to K and every aggregator,
    re-aggregated from the run's recorded votes (no model is run): the default is the setting
    with the best worst position."""
    from ragfix.eval.orders_tune import tune_orders

    with user_errors():
        table, details = tune_orders(run)
    show_tables(table, details, json_out)


def register(app: typer.Typer) -> None:
    """Add the ``tune`` command group to ``app``."""
    app.add_typer(tune, name="tune")
