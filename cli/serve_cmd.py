"""``ragfix serve``: an OpenAI-compatible server over any ragfix backend."""

from __future__ import annotations

from typing import Annotated

import typer

from ragfix.cli.common import (
    AdapterOpt,
    BackendOpt,
    BackendOptsOpt,
    CalibrationOpt,
    DeviceOpt,
    DtypeOpt,
    TrainWindowOpt,
    backend_options,
    err_console,
    user_errors,
)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the CLI."""

    @app.command("serve")
    def serve_cmd(
        model: Annotated[
            str,
            typer.Option(
                "--model",
                "-m",
                help="the model to load ('smollm2', a HF id, a folder, a .gguf); clients ask for "
                "it by this same id",
            ),
        ] = "smollm2",
        backend: BackendOpt = "vanilla",
        backend_opt: BackendOptsOpt = None,
        calibration: CalibrationOpt = None,
        adapter: AdapterOpt = None,
        train_window: TrainWindowOpt = None,
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
        prefix_reuse: Annotated[
            bool, typer.Option(help="reuse the KV cache of the prefix shared with the last request")
        ] = True,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """Serve a ragfix backend over HTTP, OpenAI-compatible: /v1/chat/completions (streaming,
        logprobs), /v1/completions, /v1/models, /health. Other programs (or ragfix with --model
        openai:ID --api-base http://HOST:PORT/v1) then use the debiased model."""
        import uvicorn

        from ragfix.backends import load_backend
        from ragfix.serve import create_app

        with user_errors():
            b = load_backend(
                backend,
                model=model,
                device=device,
                dtype=dtype,
                adapter=str(adapter) if adapter else None,
                **backend_options(backend_opt, calibration, train_window),
            )
            app_ = create_app(b, model, prefix_reuse=prefix_reuse)
        err_console.print(
            f"ragfix serve: {model} ({backend}) at http://{host}:{port}/v1", highlight=False
        )
        uvicorn.run(app_, host=host, port=port, log_level="warning")
