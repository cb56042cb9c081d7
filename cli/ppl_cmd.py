"""``ragfix eval-ppl``: perplexity by length for vanilla, GALI and the RoPE-scaling baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import (
    BackendOptsOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    console,
    parse_numbers,
    parse_options,
    user_errors,
)


def register(app: typer.Typer) -> None:
    """Add ``eval-ppl`` to ``app``."""

    @app.command("eval-ppl")
    def eval_ppl(
        data: Annotated[Path, typer.Argument(help="JSON Lines of long texts (field 'text')")],
        out: Annotated[Path, typer.Option("--out", "-o", help="output folder")] = Path("ppl"),
        model: ModelOpt = "smollm2",
        train_window: Annotated[
            int | None, typer.Option(help="trained window L (default: the model's)")
        ] = None,
        ratios: Annotated[str, typer.Option(help="lengths as multiples of L")] = "0.5,1,2,4",
        methods: Annotated[
            str, typer.Option(help="vanilla, gali, linear, dynamic, yarn (comma-separated)")
        ] = "vanilla,gali,linear,dynamic,yarn",
        samples: Annotated[int, typer.Option(min=1, help="text windows per length")] = 2,
        backend_opt: BackendOptsOpt = None,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """Perplexity at 0.5x, 1x, 2x, 4x the trained window (GALI paper's PG19 test): prints
        the table, writes ppl.json, ppl.md and ppl.png. --backend-opt applies to gali."""
        from ragfix.eval.ppl import run_ppl, table_markdown, write_report

        with user_errors():
            rows = run_ppl(
                data,
                model=model,
                train_window=train_window,
                ratios=tuple(parse_numbers(ratios, "--ratios")),
                methods=tuple(m.strip() for m in methods.split(",")),
                samples=samples,
                gali_options=parse_options(backend_opt),
                device=device,
                dtype=dtype,
                on_step=lambda s: console.print(s, highlight=False),
            )
            paths = write_report(rows, out)
        console.print(table_markdown(rows, "ppl"), highlight=False)
        console.print(f"wrote {paths['md']}, {paths['json']}, {paths['png']}")
