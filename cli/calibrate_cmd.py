"""``ragfix calibrate``: find the positional channel and scale for the channel-scaled backend."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ragfix.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    console,
    parse_numbers,
    user_errors,
)
from ragfix.errors import ConfigError


def _layers(text: str | None) -> list[int] | None:
    from ragfix.backends.channel_scaling import parse_layers

    if not text:
        return None
    try:
        return parse_layers(text)
    except ValueError as e:
        raise ConfigError(f"--{e}") from None


def register(app: typer.Typer) -> None:
    """Add the ``calibrate`` command to ``app``."""

    @app.command()
    def calibrate(
        out: Annotated[Path, typer.Option("--out", "-o", help="calibration JSON to write")],
        model: ModelOpt = "smollm2",
        samples: Annotated[
            int | None, typer.Option(help="random-text prompts to average (CPU 16, GPU 200)")
        ] = None,
        length: Annotated[
            int | None, typer.Option(help="tokens per random-text prompt (window/4, max 1000)")
        ] = None,
        kv_examples: Annotated[
            int | None, typer.Option(help="KV-retrieval calibration prompts (CPU 18, GPU 60)")
        ] = None,
        kv_pairs: Annotated[
            int | None, typer.Option(help="key-value pairs per calibration prompt (CPU 8, GPU 50)")
        ] = None,
        layers: Annotated[
            str | None, typer.Option(help="layers to scale, e.g. '9-23' (default: middle half)")
        ] = None,
        factors: Annotated[
            str | None, typer.Option(help="factor grid (default '0.5,0,-0.5,-1')")
        ] = None,
        top_k: Annotated[int, typer.Option(help="smoothest candidates ranked by loss")] = 10,
        seed: Annotated[int, typer.Option(help="seed of the random text and KV prompts")] = 0,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """Find the positional hidden-state channel, layers and scale factor of a model
        (arXiv 2406.02536) and write them to a calibration file for
        `--backend channel-scaled --calibration FILE`."""
        with user_errors():
            from ragfix.backends import load_backend
            from ragfix.calibrate import CalibrationSettings
            from ragfix.calibrate import calibrate as run_calibration

            chosen = {
                "samples": samples,
                "length": length,
                "kv_examples": kv_examples,
                "kv_pairs": kv_pairs,
                "layers": _layers(layers),
                "factors": parse_numbers(factors, "--factors"),
                "top_k": top_k,
                "seed": seed,
            }
            backend = load_backend("vanilla", model=model, device=device, dtype=dtype)
            settings = CalibrationSettings.for_backend(backend, **chosen)
            console.print(
                f"calibrating {backend.model_name}: {settings.samples} x {settings.length} "
                f"random-text tokens, {settings.kv_examples} KV prompts of {settings.kv_pairs} "
                f"pairs, layers {settings.layers[0]}-{settings.layers[-1]}"
            )
            cal = run_calibration(backend, settings)
            cal.save(out)
        table = Table(title="candidate channels (smoothest first)")
        for col in ("channel", "monotone layers", "smoothness", "loss (factor 0)"):
            table.add_column(col, justify="right")
        for c in cal.candidates:
            mark = " *" if c.channel == cal.channel else ""
            table.add_row(
                f"{c.channel}{mark}",
                str(len(c.monotone_layers)),
                f"{c.smoothness:.4g}",
                f"{c.loss:.4f}",
            )
        console.print(table)
        grid = ", ".join(f"{f}: {v:.4f}" for f, v in cal.factor_losses.items())
        console.print(f"baseline loss (unmodified): {cal.baseline_loss:.4f}")
        console.print(f"factor grid for channel {cal.channel}: {grid}")
        console.print(
            f"chosen: channel {cal.channel}, factor {cal.factor}, layers "
            f"{cal.layers[0]}-{cal.layers[-1]}; {cal.minutes:.1f} min; wrote {out}"
        )
        if cal.factor_losses[str(cal.factor)] > cal.baseline_loss:
            console.print(
                "[yellow]note:[/yellow] no factor lowers the calibration loss below the "
                "unmodified model's"
            )
