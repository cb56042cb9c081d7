"""An OpenAI-compatible HTTP server over any ragfix backend (what ``ragfix serve`` runs).

Any backend (vanilla, channel-scaled, gali, rope-scaled, truncated, any adapter) answers
``/v1/chat/completions`` (streaming and not, with ``logprobs``), ``/v1/completions`` (a raw
prompt, read as it is, with ``echo``), ``/v1/models`` and ``/health``, so an application in any
language, or ragfix itself (``--model openai:NAME --api-base http://HOST:PORT/v1``), can use a
debiased model. Built on FastAPI.

How requests run: one model thread owns the backend (:class:`ModelWorker`, holding
``Server.lock`` while it computes). Requests that arrive while it is busy wait in its queue;
answers with the same budget, stop rule and log-probability request are batched (up to
``max_batch_size`` of them, the first waiting at most ``max_wait_ms`` for company) where the
backend :attr:`~ragfix.backends.base.Backend.supports_batching`, else they run one at a time.
Tokenizing (the window check, the response's token texts) happens in the request's own thread
under ``Server.tokenizer_lock``, never the model's. A client that goes away, streaming or not,
cancels its work: a queued request is dropped, a running generation stops within one decoding
step (:class:`~ragfix.backends.base.Cancel`; a batch stops once all its clients are gone).

Slow clients (:class:`~ragfix.serve_guard.ServeLimits`, run by
:func:`~ragfix.serve_guard.server_config`): a request's head must be in
within ``header_timeout_s`` and its body within ``body_timeout_s`` of its head, else it is
answered 408 ``request_timeout`` and its connection closed; a connection made while
``max_connections`` are open is answered 503 ``too_many_connections`` and closed before it is
read (:mod:`ragfix.serve_guard`), so trickling clients never hold the server's open files.

A backend that reads passages only where a task prompt says they are
(:attr:`~ragfix.backends.base.Backend.needs_passage_spans`: ``attention-sort``, ...) is refused
at start: a request carries no passage spans.

What a request may be (anything else is refused with HTTP 400 in OpenAI's error format, one line):

* chat: one ``user`` message, optionally followed by an ``assistant`` message that the model
  continues (``continue_final_message: true``, ``add_generation_prompt: false``, vLLM's
  convention): the backend's :class:`~ragfix.prompts.TaskPrompt` (user turn in the chat
  template, assistant turn prefilled). System messages and earlier turns are not supported;
* decoding is greedy: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``seed`` are accepted
  and have no effect; the fields of :data:`NEUTRAL` are accepted at the values that leave greedy
  decoding as it is and refused at any other; ``user``, ``metadata``, ``store``,
  ``service_tier`` and ``parallel_tool_calls`` are accepted and change nothing; ``stop`` may only
  be ``"\\n"`` (the newline stop rule) or absent;
* ``max_tokens`` (or ``max_completion_tokens``) defaults to :data:`DEFAULT_MAX_TOKENS`; a prompt
  whose tokens plus ``max_tokens`` exceed the backend's window is refused (400, code
  ``context_length_exceeded``), never cut (unless the backend cuts by design, ``truncated``);
  one longer than :data:`MAX_CHARS_PER_TOKEN` characters a window token is refused so before it
  is tokenized; a body over ``max_body_bytes`` is 413;
* the answer is the continuation as the model generated it (leading white space kept, cut before
  the first newline after it with the newline rule), streamed or not alike; with
  ``stream_options: {"include_usage": true}`` a last chunk with ``choices: []`` carries the usage;
* ``logprobs`` / ``top_logprobs`` (chat, up to 20) or ``logprobs: N`` (completions): the model
  interface gives the first answer token's full distribution, computed on exactly the input the
  answer was generated from, so ``logprobs`` holds that one token (the greedy choice) and its
  top alternatives, each with its own bytes (:meth:`~ragfix.backends.base.Backend.token_bytes`;
  the text of a token that holds part of a character shows the missing bytes as ``\\xNN``);
  not with ``stream``;
* completions ``echo: true`` returns the prompt before the continuation and, with ``logprobs:
  N``, each prompt token's log-probability and its ``N`` most likely alternatives (``None`` for
  the first token), OpenAI's legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
  ``text_offset``), from :meth:`~ragfix.backends.base.Backend.token_scores`: the
  ``token_logprobs`` that ``Backend.loglikelihood`` sums, with the alternatives of the same
  pass (what lm-evaluation-harness's ``local-completions`` reads for loglikelihood requests);
  ``max_tokens: 0`` then scores the prompt without generating. A backend that does not score
  text (a remote model) refuses it (400).

Errors: an unknown model id is 404 (``model_not_found``); a missing or wrong API key 401
(``invalid_api_key``); a body not sent as ``application/json`` 415
(``unsupported_media_type``, :func:`_read`); a ``Host`` header that names another host 403
(``host_not_allowed``, :class:`~ragfix.serve_guard.HostGate`, run by
:func:`~ragfix.serve_guard.server_config`); a request too slow 408 (``request_timeout``); a
connection over the limit 503 (``too_many_connections``); every error body is
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from ragfix.errors import Cancelled, ConfigError, RagfixError
from ragfix.prompts import TaskPrompt, join_text_parts
from ragfix.serve_errors import ApiError
from ragfix.types import Generation

if TYPE_CHECKING:  # the CLI imports this module for its defaults: no torch at import
    import torch

    from ragfix.backends.base import Backend, Cancel, Prompt, TokenScores

#: answer budget of a request without ``max_tokens``
DEFAULT_MAX_TOKENS = 256
#: most alternatives per token a request may ask for
MAX_TOP_LOGPROBS = 20
#: largest request body accepted (bytes); a larger one is 413 before it is parsed
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: characters a prompt may have per token of the window: a longer prompt cannot fit (no token of
#: a usual vocabulary is longer; SmolLM2's longest is 81) and is refused before it is tokenized
MAX_CHARS_PER_TOKEN = 128
#: most answers computed in one batch
DEFAULT_MAX_BATCH_SIZE = 8
#: how long the first request of a batch waits for others to join it (milliseconds), from its
#: arrival or from when the model is free (:meth:`ModelWorker._take`): on a busy 2-core CPU the
#: clients of a batch of 8 were back 13-16 ms after it was answered
DEFAULT_MAX_WAIT_MS = 25.0
#: the environment variable ``ragfix serve`` reads its API key from (never ``OPENAI_API_KEY``,
#: which the client side reads)
API_KEY_ENV = "RAGFIX_API_KEY"
#: OpenAI request fields accepted only at the values that leave greedy decoding and the answer's
#: shape as they are (field -> those values); any other value is refused
NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "n": (1,),
    "best_of": (1,),
    "suffix": ("",),
}


class StreamOptions(BaseModel):
    """``stream_options`` (unknown options are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by chat and completions requests (unknown fields are refused; types are
    strict: ``"stream": "yes"`` or ``"max_tokens": "5"`` is a 400, not a guess)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # sampling settings: decoding is greedy, they change nothing
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    # bookkeeping fields: they change nothing
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # accepted only at their neutral values (NEUTRAL)
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check_fields(self) -> None:
        """Refuse what the server cannot honour, in one line.

        Raises:
            ApiError: a :data:`NEUTRAL` field at another value, a stop other than a newline,
                ``stream_options`` without ``stream``.
        """
        for name in sorted(self.model_fields_set & NEUTRAL.keys()):
            value, accepted = getattr(self, name), NEUTRAL[name]
            if value is not None and value not in accepted:
                allowed = " or ".join(json.dumps(v) for v in accepted)
                raise ApiError(
                    400,
                    f"{name} {json.dumps(value)} is not supported: ragfix serve decodes greedily "
                    f"one answer with the model's own distribution (accepted: {allowed})",
                    param=name,
                )
        if any(s != "\n" for s in self.stops()):
            raise ApiError(400, 'stop may only be "\\n" (the newline stop rule)', param="stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream true", param="stream_options")

    def stops(self) -> list[str]:
        """The stop strings asked for."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class Message(BaseModel):
    """One chat message (text content, or a list of text parts)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (text parts joined: :func:`ragfix.prompts.join_text_parts`).

        Raises:
            ApiError: a part that is not text.
        """
        if isinstance(self.content, list):
            if any(
                p.get("type") != "text" or not isinstance(p.get("text"), str) for p in self.content
            ):
                raise ApiError(
                    400, "only text content parts ({type: text, text: ...}) are supported",
                    param="messages",
                )  # fmt: skip
            return join_text_parts([p["text"] for p in self.content])
        return self.content or ""


class ChatRequest(_Request):
    """A ``/v1/chat/completions`` request."""

    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def check_fields(self) -> None:
        """See :meth:`_Request.check_fields`; also ``max_tokens: 0`` and logprobs with stream.

        Raises:
            ApiError: as there.
        """
        super().check_fields()
        if self.max_tokens == 0:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        if self.stream and self.logprobs:
            raise ApiError(400, "logprobs are not streamed: ask without stream", param="logprobs")

    def budget(self) -> int | None:
        """The answer budget asked for (``max_completion_tokens``, else ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens

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
    best_of: int | None = None
    suffix: str | None = None

    def check_fields(self) -> None:
        """See :meth:`_Request.check_fields`; also ``max_tokens: 0`` without ``echo``, and
        ``echo`` with ``stream``.

        Raises:
            ApiError: as there.
        """
        super().check_fields()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(
                400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens"
            )
        if self.echo and self.stream:
            raise ApiError(400, "echo is not streamed: ask without stream", param="echo")
        if self.stream and self.logprobs is not None:
            raise ApiError(400, "logprobs are not streamed: ask without stream", param="logprobs")

    def text(self) -> str:
        """The one prompt, not empty.

        Raises:
            ApiError: several prompts, or an empty one.
        """
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return prompt


# ---------------------------------------------------------------------- the model thread
class _AllSet:
    """A :class:`~ragfix.backends.base.Cancel` set once every one of ``signals`` is."""

    def __init__(self, signals: list[threading.Event]):
        self.signals = signals

    def is_set(self) -> bool:
        return all(s.is_set() for s in self.signals)


_END = object()


@dataclass(eq=False)
class Job:
    """One piece of model work, made on the event loop and computed on the model thread.

    Attributes:
        loop: the event loop that awaits it.
        run: the work (``cancel`` -> result), for a job that is not batched.
        prompt, key: a batchable answer: its prompt and ``(budget, stop rule, first_logprobs)``;
            jobs with the same key are batched.
        cancel: set when the client is gone (or the response is over); the model thread drops
            a queued job and stops a running one within a decoding step.
        arrived: when it was made (``time.monotonic``): a batch's first job waits for others
            from then, or from when the model is free if that is later.
        result: the outcome, on ``loop``; a streaming ``run`` also emits pieces (:meth:`emit`),
            read by :meth:`pieces`.
    """

    loop: asyncio.AbstractEventLoop
    run: Callable[[Cancel], Any] | None = None
    prompt: Prompt | None = None
    key: tuple | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.result: asyncio.Future = self.loop.create_future()
        self._pieces: asyncio.Queue = asyncio.Queue()

    def _call(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
            self.loop.call_soon_threadsafe(fn, *args)

    def emit(self, piece: str) -> None:
        """Hand a streamed piece to the loop (model thread)."""
        self._call(self._pieces.put_nowait, piece)

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the loop (model thread); a cancelled job's is dropped."""

        def done():
            if self.result.done():
                return
            if error is not None and not self.cancel.is_set():
                self.result.set_exception(error)
            else:
                self.result.set_result(value)
            self._pieces.put_nowait(_END)

        self._call(done)

    async def pieces(self) -> AsyncIterator[str]:
        """The streamed pieces as they come; raises what the work raised, at the end."""
        while (piece := await self._pieces.get()) is not _END:
            yield piece
        self.result.result()


class ModelWorker:
    """The thread that owns the backend: takes jobs in arrival order, batches compatible
    answers, and computes under :attr:`lock`.

    Args:
        backend: the served backend.
        prefix_reuse: passed to ``Backend.generate``.
        max_batch_size: most answers per batch (1 where the backend does not
            :attr:`~ragfix.backends.base.Backend.supports_batching`).
        max_wait_ms: how long a batch's first job waits for others, from its arrival or, when
            it arrived while the model was busy, from when the model is free (:meth:`_take`).
    """

    def __init__(
        self, backend: Backend, prefix_reuse: bool, max_batch_size: int, max_wait_ms: float
    ):
        self.backend, self.prefix_reuse = backend, prefix_reuse
        self.max_batch_size = max_batch_size if backend.supports_batching else 1
        self.max_wait = max_wait_ms / 1000
        self.lock = threading.Lock()
        self._queue: list[Job] = []
        self._ready = threading.Condition()
        #: sizes of the batches run so far (answers per ``generate`` call)
        self.batch_sizes: list[int] = []
        threading.Thread(target=self._loop, name="ragfix-model", daemon=True).start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (event loop)."""
        with self._ready:
            self._queue.append(job)
            self._ready.notify()

    def _take(self) -> list[Job]:
        """The next jobs to run together: the first queued job and, if it is a batchable
        answer, the queued ones with its key (up to the batch size), waiting until the batch is
        full or ``max_wait`` is over, counted from the first job's arrival or, for a job that
        arrived while the model was busy, from now (the model free): the clients of the batch
        just answered then join it with their next requests, rather than a job that waited
        through a batch always running alone. Cancelled jobs are dropped."""
        free = time.monotonic()
        with self._ready:
            while True:
                for job in [j for j in self._queue if j.cancel.is_set()]:
                    self._queue.remove(job)
                    job.settle(error=Cancelled())
                if not self._queue:
                    self._ready.wait()
                    continue
                first = self._queue[0]
                group = [j for j in self._queue if first.key is not None and j.key == first.key]
                group = group[: self.max_batch_size] or [first]
                left = max(first.arrived, free) + self.max_wait - time.monotonic()
                if first.key is None or len(group) >= self.max_batch_size or left <= 0:
                    for job in group:
                        self._queue.remove(job)
                    return group
                self._ready.wait(left)

    def _loop(self) -> None:
        while True:
            group = self._take()
            with self.lock:
                self._run(group)

    def _run(self, group: list[Job]) -> None:
        first = group[0]
        try:
            if first.key is None:
                first.settle(first.run(first.cancel))
                return
            budget, stop, logprobs = first.key
            self.batch_sizes.append(len(group))
            gens = self.backend.generate(
                [j.prompt for j in group],
                batch_size=len(group),
                max_new_tokens=budget,
                stop_at_newline=stop,
                first_logprobs=logprobs,
                prefix_reuse=self.prefix_reuse,
                cancel=_AllSet([j.cancel for j in group]),
            )
        except Exception as e:
            if len(group) > 1 and not isinstance(e, Cancelled):
                for job in group:  # one prompt's failure is not the others'
                    self._run([job])
                return
            for job in group:
                job.settle(error=e)
            return
        for job, gen in zip(group, gens, strict=True):
            job.settle(gen)


# ---------------------------------------------------------------------- the server
class Server:
    """The served backend: request checks, the model thread, OpenAI response bodies.

    Args:
        backend: any loaded :class:`~ragfix.backends.base.Backend`.
        model_id: the id clients ask for (``ragfix serve --model``'s value).
        prefix_reuse: let the backend reuse the KV cache of the prompt prefix it shares with the
            previous request (same greedy answers up to floating-point noise; faster when
            consecutive prompts share a head, as a sweep's do).
        max_batch_size, max_wait_ms: batching (see :class:`ModelWorker`).
    """

    def __init__(
        self,
        backend: Backend,
        model_id: str,
        prefix_reuse: bool = True,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
    ):
        self.backend, self.model_id = backend, model_id
        self.worker = ModelWorker(backend, prefix_reuse, max_batch_size, max_wait_ms)
        #: held while the model computes (by the model thread only)
        self.lock = self.worker.lock
        #: held while a request thread tokenizes or detokenizes
        self.tokenizer_lock = threading.Lock()
        self.started = int(time.time())
        self.identity = json.loads(json.dumps(backend.identity()))

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

    # ------------------------------------------------------------------ checks
    async def tokenizing(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a worker thread under :attr:`tokenizer_lock` (never the model's lock)."""
        from starlette.concurrency import run_in_threadpool

        def locked():
            with self.tokenizer_lock:
                return fn()

        return await run_in_threadpool(locked)

    async def check(self, req: _Request, prompt: Prompt, max_tokens: int | None) -> tuple[int, int]:
        """The prompt's tokens and the answer budget of a request for ``prompt``.

        Raises:
            ApiError: another model, a field the server cannot honour
                (:meth:`_Request.check_fields`), or a prompt that does not fit the window:
                longer than :data:`MAX_CHARS_PER_TOKEN` characters a window token (refused
                before tokenizing), or whose tokens plus ``max_tokens`` (default
                :data:`DEFAULT_MAX_TOKENS`; 0 with ``echo``) exceed it (:meth:`Backend.fit`);
                400 ``context_length_exceeded``.
        """
        if req.model != self.model_id:
            raise ApiError(
                404,
                f"the model {req.model!r} does not exist here (this server serves "
                f"{self.model_id!r})",
                code="model_not_found",
                param="model",
            )
        req.check_fields()
        window = self.backend.context_window
        param = "messages" if isinstance(prompt, TaskPrompt) else "prompt"
        chars = len(prompt.user + prompt.assistant_prefix) if param == "messages" else len(prompt)
        if chars > MAX_CHARS_PER_TOKEN * window:
            raise ApiError(
                400,
                f"This model's maximum context length is {window} tokens; the prompt has {chars} "
                f"characters, more than {window} tokens hold (refused before tokenizing)",
                code="context_length_exceeded",
                param=param,
            )
        budget = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        fit = await self.tokenizing(lambda: self.backend.fit(prompt, max_new_tokens=budget or 1))
        fit = replace(fit, budget=budget)
        if not fit.runs:
            raise ApiError(
                400,
                f"This model's maximum context length is {fit.window} tokens; the prompt has "
                f"{fit.prompt_tokens} tokens and max_tokens asks for {fit.budget}",
                code="context_length_exceeded",
                param=param,
            )
        return fit.prompt_tokens or 0, budget

    # ------------------------------------------------------------------ model work
    def answer_job(self, prompt: Prompt, budget: int, stop: bool, logprobs: bool) -> Job:
        """A queued, batchable greedy answer (its result: a :class:`Generation`)."""
        job = Job(asyncio.get_running_loop(), prompt=prompt, key=(budget, stop, logprobs))
        self.worker.submit(job)
        return job

    def scores_job(self, ids: list[int], top: int) -> Job:
        """Queued log-probabilities of each token of ``ids`` after the ones before it, with its
        ``top`` most likely alternatives (its result:
        :class:`~ragfix.backends.base.TokenScores` of :meth:`Backend.token_scores
        <ragfix.backends.base.Backend.token_scores>`, ``None`` for one token)."""

        def run(cancel: Cancel) -> Any:
            return self.backend.token_scores(ids, top) if len(ids) >= 2 else None

        job = Job(asyncio.get_running_loop(), run=run)
        self.worker.submit(job)
        return job

    def stream_job(self, prompt: Prompt, budget: int, stop: bool) -> Job:
        """A queued streamed answer: its pieces as the backend yields them (cut before the first
        newline after leading white space with ``stop``)."""
        from ragfix.backends.base import cut_at_newline

        job = Job(asyncio.get_running_loop())

        def run(cancel: Cancel) -> None:
            pieces = self.backend.stream(
                prompt, max_new_tokens=budget, stop_at_newline=stop, cancel=cancel
            )
            if stop:
                pieces = cut_at_newline(pieces)
            with contextlib.closing(pieces):
                for piece in pieces:
                    if piece:
                        job.emit(piece)

        job.run = run
        self.worker.submit(job)
        return job

    # ------------------------------------------------------------------ bodies
    def raw_text(self, gen: Generation, stop: bool) -> str:
        """The continuation as the model generated it (what a stream sends): the generated
        tokens decoded, cut before the first newline after leading white space with the
        newline rule (tokenizer)."""
        from ragfix.backends.base import cut_at_newline

        if gen.token_ids is None:
            return gen.text
        text = self.backend.detokenize(gen.token_ids)
        return "".join(cut_at_newline(iter([text]))) if stop else text

    def token_texts(self, ids: list[int]) -> list[tuple[str, list[int]]]:
        """``(text, bytes)`` of each token: its own bytes, and their UTF-8 text with the bytes of
        a partial character written ``\\xNN`` (tokenizer)."""
        out = []
        for b in self.backend.token_bytes(ids):
            out.append((b.decode("utf-8", errors="backslashreplace"), list(b)))
        return out

    def top(self, lps: torch.Tensor, k: int) -> list[tuple[str, list[int], float]]:
        """The ``max(k, 1)`` most likely tokens of a distribution, most likely first, as
        ``(text, bytes, logprob)`` (tokenizer)."""
        values, ids = lps.topk(max(k, 1))
        texts = self.token_texts(ids.tolist())
        return [(t, b, float(v)) for (t, b), v in zip(texts, values, strict=True)]

    def head(self, kind: str) -> dict:
        """The fields every response body starts with."""
        return {
            "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_id,
        }

    def chat_body(self, req: ChatRequest, gen: Generation, budget: int) -> dict:
        """The ``chat.completion`` body of an answer (tokenizer)."""
        logprobs = None
        if req.logprobs:
            k = req.top_logprobs or 0
            top = self.top(gen.first_logprobs, k)
            (tok, b, lp), alternatives = top[0], top[:k]
            logprobs = {
                "content": [
                    {
                        "token": tok,
                        "logprob": lp,
                        "bytes": b,
                        "top_logprobs": [
                            {"token": t, "logprob": v, "bytes": tb} for t, tb, v in alternatives
                        ],
                    }
                ]
            }
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": self.raw_text(gen, bool(req.stops()))},
            "logprobs": logprobs,
            "finish_reason": "length" if gen.new_tokens >= budget else "stop",
        }
        return {**self.head("chat.completion"), "choices": [choice], "usage": usage(gen)}

    def completion_body(
        self,
        req: CompletionRequest,
        prompt: str,
        prompt_tokens: int,
        gen: Generation | None,
        scored: tuple[list[int], TokenScores | None] | None,
        budget: int,
    ) -> dict:
        """The ``text_completion`` body: the continuation of ``gen`` (none with ``max_tokens``
        0), after the prompt with ``echo``, whose ``scored`` tokens (ids, and their
        :class:`~ragfix.backends.base.TokenScores` after the first) then lead the
        log-probabilities in OpenAI's legacy shape: ``tokens``, ``token_logprobs`` (``None``
        for the first prompt token), ``top_logprobs`` (``{token text: log-probability}`` of the
        ``logprobs`` most likely tokens at that place, ``None`` for the first prompt token) and
        ``text_offset`` (tokenizer)."""
        text = "" if gen is None else self.raw_text(gen, bool(req.stops()))
        logprobs = None
        if req.logprobs is not None:
            tokens: list[str] = []
            values: list[float | None] = []
            tops: list[dict[str, float] | None] = []
            if scored is not None:
                ids, scores = scored
                tokens = [t for t, _ in self.token_texts(ids)]
                values, tops = [None], [None]
                if scores is not None:
                    values += [float(v) for v in scores.logprobs]
                    names = self.token_texts(scores.top_ids.flatten().tolist())
                    k = scores.top_ids.shape[1]
                    for row, lps in enumerate(scores.top_logprobs.tolist()):
                        texts = [t for t, _ in names[row * k : (row + 1) * k]]
                        tops.append(_alternatives(texts, lps))
            if gen is not None:
                top = self.top(gen.first_logprobs, req.logprobs)
                tokens, values = [*tokens, top[0][0]], [*values, top[0][2]]
                best = top[: req.logprobs]
                tops.append(_alternatives([t for t, _, _ in best], [v for _, _, v in best]))
            logprobs = {
                "tokens": tokens,
                "token_logprobs": values,
                "top_logprobs": tops,
                "text_offset": _offsets(tokens),
            }
        choice = {
            "index": 0,
            "text": (prompt if req.echo else "") + text,
            "logprobs": logprobs,
            "finish_reason": "length" if gen is None or gen.new_tokens >= budget else "stop",
        }
        counts = usage(gen) if gen is not None else usage_of(prompt_tokens, 0)
        return {**self.head("text_completion"), "choices": [choice], "usage": counts}

    async def events(
        self, job: Job, kind: str, prompt_tokens: int, budget: int, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE lines of a streamed answer (``data: {chunk}``, ``data: [DONE]``): the pieces as
        the model thread yields them, then a chunk with ``finish_reason`` (``length`` when the
        streamed text counts ``max_tokens`` tokens, re-tokenized) and, with ``include_usage``,
        a ``choices: []`` chunk with the usage. A failure after the first chunk ends the stream
        with an ``{"error": ...}`` event."""
        head = self.head(kind)
        chat = kind == "chat.completion.chunk"
        extra = {"usage": None} if include_usage else {}

        def chunk(piece: str | None, finish: str | None = None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {}
                if piece:
                    delta["content"] = piece
                body = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                body = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**head, 'choices': [body], **extra})}\n\n"

        text = ""
        try:
            if chat:
                yield chunk(None, first=True)
            async for piece in job.pieces():
                text += piece
                yield chunk(piece)
            n = await self.tokenizing(lambda: self.backend.count_tokens(text))
        except RagfixError as e:
            yield f"data: {json.dumps(ApiError(400, str(e).splitlines()[0]).body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        yield chunk(None, "length" if n >= budget else "stop")
        if include_usage:
            body = {**head, "choices": [], "usage": usage_of(prompt_tokens, n)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    """An OpenAI ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage(gen: Generation) -> dict:
    """The ``usage`` of an answer."""
    return usage_of(gen.prompt_tokens, gen.new_tokens)


def _alternatives(texts: list[str], logprobs: list[float]) -> dict[str, float]:
    """OpenAI's legacy ``top_logprobs`` entry: token text -> log-probability, most likely first
    (of two tokens with one text, the likelier is kept)."""
    out: dict[str, float] = {}
    for t, v in zip(texts, logprobs, strict=True):
        out.setdefault(t, v)
    return out


def _offsets(tokens: list[str]) -> list[int]:
    """Character offset of each token text in their concatenation."""
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def _error_response(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


async def _disconnected(receive) -> None:
    """Return once the client of a request whose body was read has gone."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read(request, model: type[_Request], limit: int) -> Any:
    """The request body as ``model``, read only when it is declared ``application/json``.

    A cross-site form or a no-cors ``fetch`` can send ``text/plain``, a form's types or no type
    without a CORS preflight (FastAPI GHSA-8h2j-cgx8-6xv7), so reading such a body as JSON would
    let any web page drive a local server; only ``application/json``, which a browser sends
    cross-site only after a preflight that this server does not answer, is read.

    Raises:
        ApiError: another content type (415, before the body is read), a body over ``limit``
            bytes (413, before it is parsed), or not JSON, or not a valid ``model`` (400; lone
            surrogates and loose types included).
    """
    given = request.headers.get("content-type", "")
    if given.split(";")[0].strip().lower() != "application/json":
        raise ApiError(
            415,
            "the request body must be sent as content-type application/json (got "
            f"{repr(given) if given else 'none'})",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")
    from starlette.requests import ClientDisconnect

    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise ApiError(
                    413, f"the request body is over {limit} bytes", code="body_too_large"
                )
    except ClientDisconnect:  # gone, or cut at its body deadline: nobody reads the answer
        raise ApiError(400, "the client left before sending the whole body") from None
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        msg = first["msg"].splitlines()[0]
        raise ApiError(400, f"{loc}: {msg}" if loc else msg, param=loc or None) from None


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

    Returns:
        a ``fastapi.FastAPI`` application (run it with uvicorn:
        :func:`~ragfix.serve_guard.server_config`).

    Raises:
        ConfigError: an empty API key (:func:`check_api_key`), or a backend that reads
            passages only where a task prompt says they are
            (:attr:`~ragfix.backends.base.Backend.needs_passage_spans`): a request carries none.
    """
    from fastapi import FastAPI, Response
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    from ragfix.backends.base import require_plain_prompts

    check_api_key(api_key)
    require_plain_prompts(backend, "ragfix serve")
    server = Server(backend, model_id, prefix_reuse, max_batch_size, max_wait_ms)
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
        req = await _read(request, ChatRequest, max_body_bytes)
        prompt = req.prompt()
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
        """OpenAI text completions of a raw prompt (``echo`` scores it)."""
        req = await _read(request, CompletionRequest, max_body_bytes)
        prompt = req.text()
        n_prompt, budget = await server.check(req, prompt, req.max_tokens)
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
            ids = await server.tokenizing(lambda: backend.tokenize(prompt))
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
    "API_KEY_ENV",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_WAIT_MS",
    "MAX_CHARS_PER_TOKEN",
    "NEUTRAL",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Job",
    "KeyGate",
    "ModelWorker",
    "Server",
    "check_api_key",
    "create_app",
    "exposure_warning",
    "free_port",
    "serving",
]
