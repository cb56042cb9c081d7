"""An OpenAI-compatible HTTP server over any ragfix backend (what ``ragfix serve`` runs).

Any backend (vanilla, channel-scaled, gali, rope-scaled, truncated, any adapter) answers
``/v1/chat/completions`` (streaming and not, with ``logprobs``), ``/v1/completions`` (a raw
prompt, read as it is), ``/v1/models`` and ``/health``, so an application in any language, or
ragfix itself (``--model openai:NAME --api-base http://HOST:PORT/v1``), can use a debiased model.
Built on FastAPI; one backend is loaded at start and requests run through it one at a time (a
lock), so answers are those of the backend called directly.

What a request may be (anything else is refused with HTTP 400 in OpenAI's error format):

* chat: one ``user`` message, optionally followed by an ``assistant`` message that the model
  continues (``continue_final_message: true``, ``add_generation_prompt: false``, vLLM's
  convention): the backend's :class:`~ragfix.prompts.TaskPrompt` (user turn in the chat
  template, assistant turn prefilled). System messages and earlier turns are not supported;
* decoding is greedy: ``temperature``, ``top_p`` and ``seed`` are accepted and have no effect;
  ``n`` must be 1; ``stop`` may only be ``"\\n"`` (the newline stop rule) or absent;
* ``max_tokens`` (or ``max_completion_tokens``) defaults to :data:`DEFAULT_MAX_TOKENS`; a prompt
  whose tokens plus ``max_tokens`` exceed the backend's window is refused (400, code
  ``context_length_exceeded``), never cut (unless the backend cuts by design, ``truncated``);
* ``logprobs`` / ``top_logprobs`` (chat, up to 20) or ``logprobs: N`` (completions): the model
  interface gives the first answer token's full distribution, computed on exactly the input the
  answer was generated from, so ``logprobs.content`` holds that one token (the greedy choice)
  and its top alternatives; not with ``stream``.

Errors: an unknown model id is 404 (``model_not_found``), a malformed request 400.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ragfix.backends.base import Backend, Prompt, cut_at_newline
from ragfix.errors import RagfixError
from ragfix.prompts import TaskPrompt, join_text_parts

#: answer budget of a request without ``max_tokens``
DEFAULT_MAX_TOKENS = 256
#: most alternatives per token a request may ask for
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """A request the server refuses, answered as ``{"error": {...}}`` with ``status``."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        """The OpenAI error object."""
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class _Request(BaseModel):
    """Fields shared by chat and completions requests (unknown fields are refused)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    user: str | None = None


class Message(BaseModel):
    """One chat message (text content, or a list of text parts)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (text parts joined: :func:`ragfix.prompts.join_text_parts`).

        Raises:
            ApiError: a part that is not text.
        """
        if isinstance(self.content, list):
            if any(p.get("type") != "text" for p in self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            return join_text_parts([str(p.get("text", "")) for p in self.content])
        return self.content or ""


class ChatRequest(_Request):
    """A ``/v1/chat/completions`` request."""

    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    def prompt(self) -> TaskPrompt:
        """The backend prompt: the user message, and the assistant message to continue.

        Raises:
            ApiError: any other shape of conversation.
        """
        roles = [m.role for m in self.messages]
        if self.continue_final_message and roles == ["user", "assistant"]:
            if self.add_generation_prompt:
                raise ApiError(
                    400,
                    "continue_final_message needs add_generation_prompt false",
                    param="add_generation_prompt",
                )
            return TaskPrompt(
                user=self.messages[0].text(), assistant_prefix=self.messages[1].text()
            )
        if roles == ["user"] and not self.continue_final_message:
            return TaskPrompt(user=self.messages[0].text())
        raise ApiError(
            400,
            "ragfix serve reads one user message, optionally followed by an assistant message to "
            "continue (continue_final_message true); system messages and earlier turns are not "
            f"supported (got roles {roles})",
            param="messages",
        )


class CompletionRequest(_Request):
    """A ``/v1/completions`` request: a raw prompt, read as it is."""

    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def text(self) -> str:
        """The one prompt.

        Raises:
            ApiError: several prompts, or ``echo``.
        """
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ApiError(400, "send one prompt per request", param="prompt")
            return self.prompt[0]
        return self.prompt


class Server:
    """The served backend: request checks, generation under a lock, OpenAI response bodies.

    Args:
        backend: any loaded :class:`~ragfix.backends.base.Backend`.
        model_id: the id clients ask for (``ragfix serve --model``'s value).
        prefix_reuse: let the backend reuse the KV cache of the prompt prefix it shares with the
            previous request (same greedy answers up to floating-point noise; faster when
            consecutive prompts share a head, as a sweep's do).
    """

    def __init__(self, backend: Backend, model_id: str, prefix_reuse: bool = True):
        self.backend, self.model_id, self.prefix_reuse = backend, model_id, prefix_reuse
        self.lock = threading.Lock()
        self.started = int(time.time())
        self.identity = json.loads(json.dumps(backend.identity()))

    # ------------------------------------------------------------------ checks
    def model_entry(self) -> dict:
        """The served model's ``/v1/models`` entry, with its window (``max_model_len``) and the
        backend's identity (``ragfix``: weight fingerprint, method, options, adapter)."""
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "ragfix",
            "max_model_len": self.backend.context_window,
            "ragfix": self.identity,
        }

    def _check(self, req: _Request, prompt: Prompt, max_tokens: int | None) -> tuple[int, bool]:
        """The answer budget and stop rule of a request for ``prompt``.

        Raises:
            ApiError: another model, ``n`` other than 1, a stop other than a newline, or a
                prompt that does not fit the window (:meth:`Backend.fit`, ``max_tokens``
                defaulting to :data:`DEFAULT_MAX_TOKENS`; 400 ``context_length_exceeded``).
        """
        if req.model != self.model_id:
            raise ApiError(
                404,
                f"the model {req.model!r} does not exist here (this server serves "
                f"{self.model_id!r})",
                code="model_not_found",
                param="model",
            )
        if req.n != 1:
            raise ApiError(400, "n must be 1 (decoding is greedy)", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(s != "\n" for s in stops):
            raise ApiError(400, 'stop may only be "\\n" (the newline stop rule)', param="stop")
        with self.lock:  # the tokenizer is not shared across threads
            fit = self.backend.fit(prompt, max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS)
        if not fit.runs:
            raise ApiError(
                400,
                f"This model's maximum context length is {fit.window} tokens; the prompt has "
                f"{fit.prompt_tokens} tokens and max_tokens asks for {fit.budget}",
                code="context_length_exceeded",
                param="messages",
            )
        return fit.budget, bool(stops)

    # ------------------------------------------------------------------ answers
    def _generate(self, prompt: Prompt, budget: int, stop: bool, logprobs: bool):
        with self.lock:
            [gen] = self.backend.generate(
                [prompt],
                batch_size=1,
                max_new_tokens=budget,
                stop_at_newline=stop,
                first_logprobs=logprobs,
                prefix_reuse=self.prefix_reuse,
            )
        return gen

    def _top(self, lps: torch.Tensor, k: int) -> tuple[tuple[str, float], list[tuple[str, float]]]:
        """The greedy first token ``(text, logprob)`` and the ``k`` most likely ones."""
        values, ids = lps.topk(max(k, 1))
        pairs = [
            (self.backend.detokenize([int(i)]), float(v)) for v, i in zip(values, ids, strict=True)
        ]
        return pairs[0], pairs[:k]

    def _head(self, kind: str) -> dict:
        return {
            "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_id,
        }

    def chat(self, req: ChatRequest):
        """A chat completion (a dict) or, with ``stream``, an iterator of SSE lines.

        Raises:
            ApiError: see :meth:`_check`, :meth:`ChatRequest.prompt`; logprobs with stream.
        """
        prompt = req.prompt()
        budget, stop = self._check(req, prompt, req.max_completion_tokens or req.max_tokens)
        if req.stream:
            if req.logprobs:
                raise ApiError(
                    400, "logprobs are not streamed: ask without stream", param="logprobs"
                )
            return self._stream(prompt, budget, stop, "chat.completion.chunk")
        gen = self._generate(prompt, budget, stop, req.logprobs)
        logprobs = None
        if req.logprobs:
            (tok, lp), top = self._top(gen.first_logprobs, req.top_logprobs or 0)
            logprobs = {
                "content": [
                    {
                        "token": tok,
                        "logprob": lp,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top
                        ],
                    }
                ]
            }
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": gen.text},
            "logprobs": logprobs,
            "finish_reason": "length" if gen.new_tokens >= budget else "stop",
        }
        return {**self._head("chat.completion"), "choices": [choice], "usage": _usage(gen)}

    def complete(self, req: CompletionRequest):
        """A text completion (a dict) or, with ``stream``, an iterator of SSE lines.

        Raises:
            ApiError: see :meth:`_check`, :meth:`CompletionRequest.text`; logprobs with stream.
        """
        prompt = req.text()
        budget, stop = self._check(req, prompt, req.max_tokens)
        want = req.logprobs is not None
        if req.stream:
            if want:
                raise ApiError(
                    400, "logprobs are not streamed: ask without stream", param="logprobs"
                )
            return self._stream(prompt, budget, stop, "text_completion")
        gen = self._generate(prompt, budget, stop, want)
        logprobs = None
        if want:
            (tok, lp), top = self._top(gen.first_logprobs, req.logprobs)
            alternatives: dict[str, float] = {}
            for t, v in top:
                alternatives.setdefault(t, v)
            logprobs = {
                "tokens": [tok],
                "token_logprobs": [lp],
                "top_logprobs": [alternatives],
                "text_offset": [0],
            }
        choice = {
            "index": 0,
            "text": gen.text,
            "logprobs": logprobs,
            "finish_reason": "length" if gen.new_tokens >= budget else "stop",
        }
        return {**self._head("text_completion"), "choices": [choice], "usage": _usage(gen)}

    def _stream(self, prompt: Prompt, budget: int, stop: bool, kind: str) -> Iterator[str]:
        """SSE lines of a streamed answer (``data: {chunk}``, then ``data: [DONE]``); the lock is
        held while it streams and released when the client goes away. ``finish_reason`` is
        ``length`` when the streamed text counts ``max_tokens`` tokens (re-tokenized)."""
        head = self._head(kind)
        chat = kind == "chat.completion.chunk"

        def chunk(piece: str | None, finish: str | None = None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if piece:
                    delta["content"] = piece
                body = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                body = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [body]})}\n\n"

        def events() -> Iterator[str]:
            with self.lock:
                pieces = self.backend.stream(prompt, max_new_tokens=budget, stop_at_newline=stop)
                if stop:
                    pieces = cut_at_newline(pieces)
                text = ""
                try:
                    if chat:
                        yield chunk(None, first=True)
                    for piece in pieces:
                        if piece:
                            text += piece
                            yield chunk(piece)
                finally:
                    pieces.close()
                done = self.backend.count_tokens(text) >= budget
                yield chunk(None, "length" if done else "stop")
                yield "data: [DONE]\n\n"

        return events()


def _usage(gen) -> dict:
    return {
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": gen.new_tokens,
        "total_tokens": gen.prompt_tokens + gen.new_tokens,
    }


def create_app(backend: Backend, model_id: str, prefix_reuse: bool = True):
    """The FastAPI application serving ``backend`` as model ``model_id`` (see the module
    docstring).

    Args:
        backend: a loaded backend.
        model_id: the id clients ask for.
        prefix_reuse: see :class:`Server`.

    Returns:
        a ``fastapi.FastAPI`` application (run it with uvicorn).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    server = Server(backend, model_id, prefix_reuse)
    app = FastAPI(title="ragfix serve", version="1")
    app.state.server = server

    @app.exception_handler(ApiError)
    def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"] if x != "body")
        return JSONResponse(
            ApiError(400, f"{loc}: {first['msg']}", param=loc or None).body(), status_code=400
        )

    @app.exception_handler(RagfixError)
    def _ragfix(request: Request, e: RagfixError):
        return JSONResponse(ApiError(400, str(e).splitlines()[0]).body(), status_code=400)

    def _respond(out):
        if isinstance(out, dict):
            return out
        return StreamingResponse(out, media_type="text/event-stream")

    @app.get("/health")
    def health() -> dict:
        """Liveness: ``{"status": "ok", "model": id}``."""
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
    def chat(req: ChatRequest):
        """OpenAI chat completions (see the module docstring)."""
        return _respond(server.chat(req))

    @app.post("/v1/completions")
    def complete(req: CompletionRequest):
        """OpenAI text completions of a raw prompt."""
        return _respond(server.complete(req))

    return app


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(*args: str, host: str = "127.0.0.1", timeout: float = 180.0) -> Iterator[str]:
    """Run ``ragfix serve ARGS`` as a subprocess on a free port of ``host`` (one thread per
    math library) until the block ends; yields its ``/v1`` base URL once ``/health`` answers.

    Raises:
        RuntimeError: the server exited, or did not answer within ``timeout`` seconds (its
            last output in the message).
    """
    import os
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    port = free_port(host)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ragfix.cli", "serve", *args, "--host", host, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ragfix serve exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ragfix serve did not answer in {timeout:.0f} s") from None
                time.sleep(0.5)
        yield url + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Server",
    "create_app",
    "free_port",
    "serving",
]
