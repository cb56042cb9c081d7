"""``ragfix calibrate``: find the positional channel and scale for the channel-scaled backend."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
        table: Annotated[
            Path | None,
            typer.Option(help="also write the result table for `ragfix render` (results/)"),
        ] = None,
        model: ModelOpt = "smollm2",
        samples: Annotated[
            int | None, typer.Option(help="random-text prompts to average (CPU 64, GPU 200)")
        ] = None,
        length: Annotated[
            int | None, typer.Option(help="tokens per random-text prompt (window/4, max 1000)")
        ] = None,
        kv_examples: Annotated[
            int | None,
            typer.Option(help="generated KV-retrieval prompts, half held out (CPU 48, GPU 60)"),
        ] = None,
        kv_pairs: Annotated[
            int | None, typer.Option(help="key-value pairs per KV prompt (CPU 8, GPU 50)")
        ] = None,
        qa_data: Annotated[
            str | None,
            typer.Option(help="QA file for the NQ half of the calibration set (default: KV only)"),
        ] = None,
        qa_records: Annotated[
            str, typer.Option(help="record range of --qa-data, disjoint from your test records")
        ] = "0:",
        qa_examples: Annotated[
            int | None, typer.Option(help="QA prompts, half held out (default: as many as KV)")
        ] = None,
        qa_docs: Annotated[int, typer.Option(help="passages per QA prompt")] = 10,
        layers: Annotated[
            str | None, typer.Option(help="layers to scale, e.g. '9-23' (default: middle half)")
        ] = None,
        factors: Annotated[
            str | None, typer.Option(help="factor grid (default '0.5,0,-0.5,-1')")
        ] = None,
        top_k: Annotated[int, typer.Option(help="smoothest candidates ranked by loss")] = 10,
        objective: Annotated[
            str, typer.Option(help="'loss' (the paper's) or 'gap' (between gold depths)")
        ] = "loss",
        finalists: Annotated[
            int, typer.Option(help="tuned settings compared with the unmodified model, held out")
        ] = 3,
        seed: Annotated[int, typer.Option(help="seed of the random text and KV prompts")] = 0,
        stability_seed: Annotated[
            int | None, typer.Option(help="second random-text seed: report the top-k overlap")
        ] = None,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """Find the positional hidden-state channel, layers and scale factor of a model
        (arXiv 2406.02536) and write them to a calibration file for
        `--backend channel-scaled --calibration FILE`."""
        with user_errors():
            from ragfix.backends import load_backend
            from ragfix.backends.channel_scaling.calibrate import CalibrationSettings
            from ragfix.backends.channel_scaling.calibrate import calibrate as run_calibration
            from ragfix.bundled import resolve_data

            chosen = {
                "samples": samples,
                "length": length,
                "kv_examples": kv_examples,
                "kv_pairs": kv_pairs,
                "qa_data": str(resolve_data(qa_data)) if qa_data else None,
                "qa_records": qa_records,
                "qa_examples": qa_examples,
                "qa_docs": qa_docs,
                "layers": _layers(layers),
                "factors": parse_numbers(factors, "--factors"),
                "top_k": top_k,
                "objective": objective,
                "finalists": finalists,
                "seed": seed,
                "stability_seed": stability_seed,
            }
            backend = load_backend("vanilla", model=model, device=device, dtype=dtype)
            settings = CalibrationSettings.for_backend(backend, **chosen)
            qa = (
                f", {settings.qa_examples} QA prompts of {settings.qa_docs} passages"
                if settings.qa_data
                else ""
            )
            console.print(
                f"calibrating {backend.model_name}: {settings.samples} x {settings.length} "
                f"random-text tokens, {settings.kv_examples} KV prompts of {settings.kv_pairs} "
                f"pairs{qa}, layers {settings.layers[0]}-{settings.layers[-1]}, "
                f"objective {settings.objective}"
            )
            cal = run_calibration(backend, settings)
            cal.save(out)
        _print_result(cal, out, table)


def _print_result(cal, out: Path, table: Path | None) -> None:
    from ragfix.backends.channel_scaling.calibrate import calibration_table
    from ragfix.eval.results import write_benchmark
    from ragfix.tables import print_tables

    spec = calibration_table(cal)
    print_tables([spec], console)
    if table is not None:
        write_benchmark(table, spec, calibration=cal.model_dump(mode="json"))
        console.print(f"wrote {table}")
    console.print(f"{cal.minutes:.1f} min; wrote {out}")
