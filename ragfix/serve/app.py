"""The routes of ``ragfix serve``: the FastAPI application over a
:class:`~ragfix.serve.server.Server` (:func:`create_app`), its API key gate and the checks of the
key and of the address served."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request

from ragfix.errors import ConfigError, RagfixError
from ragfix.serve.scheduler import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_WAIT_MS, Job
from ragfix.serve.schemas import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_DOCUMENTS,
    ChatRequest,
    CompletionRequest,
    read_request,
)
from ragfix.serve.server import Server
from ragfix.serve_errors import ApiError

if TYPE_CHECKING:
    from ragfix.backends.base import Backend

#: the environment variable ``ragfix serve`` reads its API key from (never ``OPENAI_API_KEY``,
#: which the client side reads)
API_KEY_ENV = "RAGFIX_API_KEY"


def _error_response(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


async def _disconnected(receive) -> None:
    """Return once the client of a request whose body was read has gone."""
    while (await receive())["type"] != "http.disconnect":
        pass


class KeyGate:
    """ASGI middleware: every HTTP route but ``/health`` needs ``Authorization: Bearer KEY``,
    compared in constant time (``hmac.compare_digest``); otherwise 401 ``invalid_api_key``."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refusal = ApiError(
                    401,
                    "missing or wrong API key (send Authorization: Bearer KEY)",
                    code="invalid_api_key",
                )
                await _error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_api_key(api_key: str | None) -> None:
    """Refuse an API key that is empty or white space (an unset ``$RAGFIX_API_KEY=`` in a shell
    or a compose file), which would otherwise serve with no key at all.

    Raises:
        ConfigError: such a key (one line, naming ``--api-key`` and :data:`API_KEY_ENV`).
    """
    if api_key is not None and not api_key.strip():
        raise ConfigError(
            f"the API key is empty (--api-key or ${API_KEY_ENV}): give a key, or unset "
            f"{API_KEY_ENV} to serve without one"
        )


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A one-line warning when ``host`` is not a loopback address and no API key is set (anyone
    who reaches the address can use the model), else ``None``."""
    if api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"warning: serving on {host} without an API key: anyone who reaches this address can use "
        f"the model (give --api-key or ${API_KEY_ENV})"
    )


def create_app(
    backend: Backend,
    model_id: str,
    prefix_reuse: bool = True,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
    max_documents: int = DEFAULT_MAX_DOCUMENTS,
):
    """The FastAPI application serving ``backend`` as model ``model_id`` (see the module
    docstring).

    Args:
        backend: a loaded backend.
        model_id: the id clients ask for.
        prefix_reuse: see :class:`Server`.
        api_key: when given, every route but ``/health`` needs ``Authorization: Bearer KEY``
            (compared in constant time; 401 otherwise), and ``/docs`` and the OpenAPI schema are
            off.
        max_body_bytes: larger request bodies are refused (413).
        max_batch_size, max_wait_ms: batching (see :class:`ModelWorker`).
        max_documents: most ``documents`` a chat request may send (more: 400).

    Returns:
        a ``fastapi.FastAPI`` application (run it with uvicorn:
        :func:`~ragfix.serve_guard.server_config`).

    A backend that reads passages only where a task prompt says they are
    (:func:`~ragfix.backends.base.plain_prompt_refusal`: ``attention-sort``, ``pine``,
    ``set-based``, ``calibrated-attention``, order marginalization) is served: it answers the
    chat requests that send their passages as ``documents`` and refuses the others (400, param
    ``documents``).

    Raises:
        ConfigError: an empty API key (:func:`check_api_key`).
    """
    from fastapi import FastAPI, Response
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    check_api_key(api_key)
    server = Server(backend, model_id, prefix_reuse, max_batch_size, max_wait_ms, max_documents)
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ragfix serve", version="1", **docs)
    app.state.server = server

    class EventStream(StreamingResponse):
        """An SSE answer whose model work is cancelled however the response ends (finished, the
        client gone, the server stopping)."""

        def __init__(self, events: AsyncIterator[str], job: Job):
            super().__init__(events, media_type="text/event-stream")
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.job.cancel.set()

    if api_key is not None:
        app.add_middleware(KeyGate, api_key=api_key)

    @app.exception_handler(ApiError)
    def _api_error(request: Request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(HTTPException)
    def _http_error(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error_response(ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(RagfixError)
    def _ragfix(request: Request, e: RagfixError):
        return _error_response(ApiError(400, str(e).splitlines()[0]))

    @app.exception_handler(Exception)
    def _bug(request: Request, e: Exception):
        return JSONResponse(
            ApiError(500, f"internal error: {type(e).__name__}").body(), status_code=500
        )

    async def _wait(request: Request, *jobs: Job) -> list | None:
        """The jobs' results, or ``None`` (their work cancelled) once the client is gone."""
        gone = asyncio.ensure_future(_disconnected(request.receive))
        done = asyncio.gather(*(j.result for j in jobs))
        try:
            await asyncio.wait({gone, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not done.done():
            for job in jobs:
                job.cancel.set()
            done.cancel()
            # the jobs end cancelled: their gathered CancelledError is read here, not logged
            done.add_done_callback(lambda f: f.cancelled() or f.exception())
            return None
        return done.result()

    @app.get("/health")
    def health() -> dict:
        """Liveness: ``{"status": "ok", "model": id}`` (no API key needed)."""
        return {"status": "ok", "model": model_id}

    @app.get("/v1/models")
    def models() -> dict:
        """The one served model."""
        return {"object": "list", "data": [server.model_entry()]}

    @app.get("/v1/models/{name:path}")
    def model(name: str) -> dict:
        """The served model's entry (404 for another id)."""
        if name != model_id:
            raise ApiError(404, f"the model {name!r} does not exist here", code="model_not_found")
        return server.model_entry()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        """OpenAI chat completions (see the module docstring)."""
        req = await read_request(request, ChatRequest, max_body_bytes)
        prompt = req.prompt(server.max_documents)
        n_prompt, budget = await server.check(req, prompt, req.budget())
        stop = bool(req.stops())
        if req.stream:
            job = server.stream_job(prompt, budget, stop)
            events = server.events(
                job, "chat.completion.chunk", n_prompt, budget, req.include_usage()
            )
            return EventStream(events, job)
        got = await _wait(request, server.answer_job(prompt, budget, stop, req.logprobs))
        if got is None:
            return Response(status_code=499)
        return await server.tokenizing(lambda: server.chat_body(req, got[0], budget))

    @app.post("/v1/completions")
    async def complete(request: Request):
        """OpenAI text completions of a raw prompt, a text or token ids (``echo`` scores it: the
        tokens the model reads for the text, its BOS first where its tokenizer puts one, as
        vLLM echoes; token ids as they are)."""
        req = await read_request(request, CompletionRequest, max_body_bytes)
        prompt, ids = req.text(), None
        if isinstance(prompt, list):  # token ids: scored as they are, answered from their text
            ids = prompt
            prompt = await server.tokenizing(lambda: server.ids_text(ids))
        n_prompt, budget = await server.check(req, prompt, req.max_tokens)
        n_prompt = n_prompt if ids is None else len(ids)
        stop = bool(req.stops())
        if req.stream:
            job = server.stream_job(prompt, budget, stop)
            events = server.events(job, "text_completion", n_prompt, budget, req.include_usage())
            return EventStream(events, job)
        jobs = []
        if budget:
            jobs.append(server.answer_job(prompt, budget, stop, req.logprobs is not None))
        scoring = req.echo and req.logprobs is not None
        if scoring:
            if not backend.has_tokenizer:
                raise ApiError(
                    400,
                    "echo with logprobs scores the prompt's tokens, and this backend has no "
                    "tokenizer here",
                    param="echo",
                )
            if ids is None:  # what the model reads for the text: its BOS first, if it has one
                ids = await server.tokenizing(lambda: backend.encode(prompt))
            jobs.append(server.scores_job(ids, req.logprobs))
        got = await _wait(request, *jobs)
        if got is None:
            return Response(status_code=499)
        gen = got[0] if budget else None
        scored = (ids, got[-1]) if scoring else None
        return await server.tokenizing(
            lambda: server.completion_body(req, prompt, n_prompt, gen, scored, budget)
        )

    return app


__all__ = ["API_KEY_ENV", "KeyGate", "check_api_key", "create_app", "exposure_warning"]
