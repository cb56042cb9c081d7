"""``ragfix serve``: an OpenAI-compatible server over any ragfix backend."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ragfix.cli.common import (
    BACKEND_OPTIONS,
    ORDER_OPTIONS,
    REMOTE_OPTIONS,
    backend_reference,
    err_console,
    order_options,
    user_errors,
)
from ragfix.serve import (
    API_KEY_ENV,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_WAIT_MS,
)
from ragfix.serve_guard import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_WRITE_TIMEOUT_S,
)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the CLI."""

    @app.command("serve")
    @ORDER_OPTIONS
    @REMOTE_OPTIONS
    @BACKEND_OPTIONS.replace(
        model=(
            Annotated[
                str,
                typer.Option(
                    "--model",
                    "-m",
                    help="the model to load ('smollm2', a HF id, a folder, a .gguf); clients ask "
                    "for it by this same id",
                ),
            ],
            "smollm2",
        )
    )
    def serve_cmd(
        max_documents: Annotated[
            int,
            typer.Option(min=1, help="most documents a chat request may send (more: HTTP 400)"),
        ] = DEFAULT_MAX_DOCUMENTS,
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
        prefix_reuse: Annotated[
            bool, typer.Option(help="reuse the KV cache of the prefix shared with the last request")
        ] = True,
        api_key: Annotated[
            str | None,
            typer.Option(
                envvar=API_KEY_ENV,
                show_envvar=True,
                help="require 'Authorization: Bearer KEY' on every route but /health (and turn "
                "/docs off)",
            ),
        ] = None,
        max_body_bytes: Annotated[
            int, typer.Option(min=1, help="larger request bodies are refused (HTTP 413)")
        ] = DEFAULT_MAX_BODY_BYTES,
        max_batch_size: Annotated[
            int,
            typer.Option(
                min=1,
                help="most answers decoded together (the rows of a decoding step, continuous "
                "batching; or a whole batch where the backend cannot decode step by step)",
            ),
        ] = DEFAULT_MAX_BATCH_SIZE,
        max_wait_ms: Annotated[
            float,
            typer.Option(
                min=0,
                help="where the backend cannot decode step by step (whole batches): how long a "
                "batch's first request waits for others (ms), from its arrival or, if it came "
                "while the model was busy, from when the model is free",
            ),
        ] = DEFAULT_MAX_WAIT_MS,
        header_timeout: Annotated[
            float,
            typer.Option(
                help="seconds a client may take to send a request's head (from connecting, or "
                "from its previous answer); later: HTTP 408 and the connection closed",
            ),
        ] = DEFAULT_HEADER_TIMEOUT_S,
        body_timeout: Annotated[
            float,
            typer.Option(
                help="seconds a client may take to send a request's body once its head is in; "
                "later: HTTP 408 and the connection closed",
            ),
        ] = DEFAULT_BODY_TIMEOUT_S,
        keep_alive_timeout: Annotated[
            float, typer.Option(help="seconds an idle connection is kept open after an answer")
        ] = DEFAULT_KEEP_ALIVE_S,
        max_connections: Annotated[
            int,
            typer.Option(
                help="most connections open at once; one more gets HTTP 503 and is closed "
                "before it is read",
            ),
        ] = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_client: Annotated[
            int,
            typer.Option(
                help="most of those connections one client address may hold; one more gets "
                "HTTP 503 and is closed before it is read",
            ),
        ] = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        write_timeout: Annotated[
            float,
            typer.Option(
                help="seconds an answer may wait for a client that does not read it; later its "
                "connection is closed",
            ),
        ] = DEFAULT_WRITE_TIMEOUT_S,
        allowed_hosts: Annotated[
            str,
            typer.Option(
                help="host names the server answers to besides its own address (127.0.0.1, "
                "localhost, [::1], --host), comma-separated, NAME or NAME:PORT, '*' for any; "
                "another Host header gets HTTP 403 (a web page rebinding its name to this address)",
            ),
        ] = "",
        backend_flags: dict | None = None,
        order_flags: dict | None = None,
        remote: dict | None = None,
    ) -> None:
        """Serve a ragfix backend over HTTP, OpenAI-compatible: /v1/chat/completions (streaming,
        logprobs), /v1/completions (echo), /v1/models, /health. Other programs (or ragfix with
        --model openai:ID --api-base http://HOST:PORT/v1) then use the debiased model. Concurrent
        requests are batched; a client that goes away cancels its generation; a client too slow
        to send its request is cut off (408), and connections beyond --max-connections are
        refused (503). Bodies are read only as application/json (415 otherwise) and only
        requests for the server's own host names (or --allowed-hosts) are answered (403
        otherwise), so no web page can drive it. A chat request may send its retrieved passages as
        documents ([{"title": ..., "text": ...}], vLLM's field): the server then builds the QA
        task's prompt, which says where each passage is; a backend that needs that
        (attention-sort, pine, set-based, calibrated-attention) or --orders answers only such
        requests (HTTP 400 naming documents for the others)."""
        import uvicorn

        from ragfix.serve import check_api_key, create_app, exposure_warning
        from ragfix.serve_guard import ServeLimits, reserve_open_files, server_config

        if api_key is None:  # click reads a set but empty variable as unset: an open server
            api_key = os.environ.get(API_KEY_ENV)
        with user_errors():
            check_api_key(api_key)
            limits = ServeLimits(
                header_timeout_s=header_timeout,
                body_timeout_s=body_timeout,
                keep_alive_s=keep_alive_timeout,
                max_connections=max_connections,
                max_connections_per_client=max_connections_per_client,
                write_timeout_s=write_timeout,
                allowed_hosts=allowed_hosts,
            )
            orders = order_options(order_flags or {})
            reserve_open_files(limits)
            ref = backend_reference(backend_flags, remote, orders)
            b = ref.load(shared=False)
            app_ = create_app(
                b,
                ref.model,
                prefix_reuse=prefix_reuse,
                api_key=api_key,
                max_body_bytes=max_body_bytes,
                max_batch_size=max_batch_size,
                max_wait_ms=max_wait_ms,
                max_documents=max_documents,
            )
        warning = exposure_warning(host, api_key)
        if warning:
            err_console.print(warning, highlight=False)
        over = "" if orders is None else f", over {orders.orders} orders of the documents"
        err_console.print(
            f"ragfix serve: {ref.model} ({ref.name}{over}) at http://{host}:{port}/v1",
            highlight=False,
        )
        uvicorn.Server(server_config(app_, host, port, limits)).run()
