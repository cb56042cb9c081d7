"""``ragfix eval-ppl``: perplexity by length for vanilla, GALI, the RoPE-scaling baselines and
truncation, over a range of text windows, with GALI settings as a grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import (
    BackendOptsOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    RestartOpt,
    ShardOpt,
    console,
    parse_numbers,
    parse_options,
    shard_finished,
    shard_value,
    user_errors,
)
from ragfix.errors import ConfigError


def parse_grid(items: list[str] | None) -> dict[str, list]:
    """``["chunk_size=32,64", "local_window=8,16"]`` to ``{"chunk_size": [32, 64], ...}``
    (values parsed as JSON when they can be: numbers, ``true``/``false``).

    Raises:
        ConfigError: an item without ``=``, without values, or an option given twice.
    """
    grid: dict[str, list] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not values.strip():
            raise ConfigError(f"--gali-grid {item!r}: expected option=value,value,...")
        if key in grid:
            raise ConfigError(f"--gali-grid: {key} given twice")
        try:
            grid[key] = json.loads(f"[{values}]")
        except json.JSONDecodeError:
            grid[key] = [v.strip() for v in values.split(",") if v.strip()]
    return grid


def register(app: typer.Typer) -> None:
    """Add ``eval-ppl`` to ``app``."""

    @app.command("eval-ppl")
    def eval_ppl(
        data: Annotated[Path, typer.Argument(help="JSON Lines of long texts (field 'text')")],
        out: Annotated[
            Path, typer.Option("--out", "-o", help="run folder (resumable, by text window)")
        ] = Path("ppl"),
        model: ModelOpt = "smollm2",
        train_window: Annotated[
            int | None, typer.Option(help="trained window L (default: the model's)")
        ] = None,
        ratios: Annotated[str, typer.Option(help="lengths as multiples of L")] = "0.5,1,2,4",
        methods: Annotated[
            str,
            typer.Option(
                help="vanilla, gali, linear, dynamic, yarn, truncated (comma-separated, in order)"
            ),
        ] = "vanilla,gali,linear,dynamic,yarn,truncated",
        samples: Annotated[
            int | None, typer.Option(min=1, help="text windows 0..N-1 (default 2); or --windows")
        ] = None,
        windows: Annotated[
            str | None,
            typer.Option(
                help="text windows START:STOP (windows START..STOP-1; window k starts at token "
                "k x the longest length): keep tuning and test windows apart"
            ),
        ] = None,
        gali_grid: Annotated[
            list[str] | None,
            typer.Option(
                help="GALI option=v1,v2,... (repeatable): one gali method per combination, "
                "labelled gali[option=v,...]"
            ),
        ] = None,
        baseline: Annotated[
            str | None,
            typer.Option(
                help="method label the others are paired with (default vanilla, when run)"
            ),
        ] = None,
        backend_opt: BackendOptsOpt = None,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
        restart: RestartOpt = False,
        shard: ShardOpt = None,
    ) -> None:
        """Perplexity at 0.5x, 1x, 2x, 4x the trained window (GALI paper's PG19 test), with 95%
        bootstrap intervals over text windows, the ratio to a baseline (paired by window) and
        perplexity by query position ID (interpolated vs whole number): prints the tables,
        writes ppl.json (render it with the ppl table kind), ppl.md and ppl.png. --backend-opt
        applies to gali."""
        from ragfix.eval.ppl import parse_windows, run_ppl, write_report
        from ragfix.eval.ppl_tables import ppl_tables
        from ragfix.tables import print_tables

        with user_errors():
            job = shard_value(shard)
            if samples is not None and windows is not None:
                raise ConfigError("give --samples N or --windows START:STOP, not both")
            window_range = parse_windows(windows) if windows else range(samples or 2)
            result = run_ppl(
                data,
                model=model,
                train_window=train_window,
                ratios=tuple(parse_numbers(ratios, "--ratios")),
                methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
                windows=window_range,
                gali_options=parse_options(backend_opt),
                gali_grid=parse_grid(gali_grid),
                baseline=baseline,
                device=device,
                dtype=dtype,
                out=out,
                restart=restart,
                shard=job,
                on_step=lambda s: console.print(s, highlight=False, markup=False),
                console=console,
            )
            if shard_finished(result):
                return
            paths = write_report(result, out)
        print_tables(ppl_tables(result), console)
        console.print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
