"""The served backend of ``ragfix serve`` (:class:`Server`): the checks of a request against the
model (its id, the window), the model work it queues on the model thread
(:class:`~ragfix.serve.scheduler.ModelWorker`) and the OpenAI response bodies of the results."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ragfix.errors import RagfixError
from ragfix.prompts import TaskPrompt
from ragfix.serve.scheduler import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_WAIT_MS, Job, ModelWorker
from ragfix.serve.schemas import (
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_TOKENS,
    MAX_CHARS_PER_TOKEN,
    ApiRequest,
    ChatRequest,
    CompletionRequest,
)
from ragfix.serve_errors import ApiError
from ragfix.types import Generation

if TYPE_CHECKING:  # the CLI imports the package for its defaults: no torch at import
    from ragfix.backends.base import Backend, Cancel, Prompt, TokenScores


class Server:
    """The served backend: request checks, the model thread, OpenAI response bodies.

    Args:
        backend: any loaded :class:`~ragfix.backends.base.Backend`.
        model_id: the id clients ask for (``ragfix serve --model``'s value).
        prefix_reuse: let the backend reuse the KV cache of the prompt prefix it shares with the
            previous request (same greedy answers up to floating-point noise; faster when
            consecutive prompts share a head, as a sweep's do).
        max_batch_size, max_wait_ms: batching (see :class:`ModelWorker`).
        max_documents: most ``documents`` a chat request may send.

    Attributes:
        needs_documents: why the backend refuses a prompt that does not say where its passages
            are (:func:`~ragfix.backends.base.plain_prompt_refusal`: a span backend,
            order marginalization), or ``None``; then only chat requests with ``documents`` are
            answered.
    """

    def __init__(
        self,
        backend: Backend,
        model_id: str,
        prefix_reuse: bool = True,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
        max_documents: int = DEFAULT_MAX_DOCUMENTS,
    ):
        from ragfix.backends.base import plain_prompt_refusal
        from ragfix.backends.orders import OrderMarginalBackend

        self.backend, self.model_id = backend, model_id
        self.max_documents = max_documents
        self.needs_documents = (
            "this server answers over several orders of a prompt's passages (--orders), so it "
            "must know where they are"
            if isinstance(backend, OrderMarginalBackend)
            else plain_prompt_refusal(backend)
        )
        self.worker = ModelWorker(backend, prefix_reuse, max_batch_size, max_wait_ms)
        #: held while the model thread has work (rows decoding, a job running)
        self.lock = self.worker.lock
        #: held while a request thread tokenizes or detokenizes
        self.tokenizer_lock = threading.Lock()
        self.started = int(time.time())
        self.identity = json.loads(json.dumps(backend.identity()))

    def model_entry(self) -> dict:
        """The served model's ``/v1/models`` entry, with its window (``max_model_len``), the
        backend's identity (``ragfix``: weight fingerprint, method, options, adapter) and, for a
        backend that answers only requests sending ``documents``, why
        (``ragfix_needs_documents``: a ragfix client refuses it at start)."""
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.started,
            "owned_by": "ragfix",
            "max_model_len": self.backend.context_window,
            "ragfix": self.identity,
            **({"ragfix_needs_documents": self.needs_documents} if self.needs_documents else {}),
        }

    # ------------------------------------------------------------------ checks
    async def tokenizing(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a worker thread under :attr:`tokenizer_lock` (never the model's lock)."""
        from starlette.concurrency import run_in_threadpool

        def locked():
            with self.tokenizer_lock:
                return fn()

        return await run_in_threadpool(locked)

    async def check(
        self, req: ApiRequest, prompt: Prompt, max_tokens: int | None
    ) -> tuple[int, int]:
        """The prompt's tokens and the answer budget of a request for ``prompt``.

        Raises:
            ApiError: another model, a field the server cannot honour
                (:meth:`ApiRequest.check_fields`), a prompt without passage spans for a backend
                that needs them (:attr:`needs_documents`; param ``documents``, ``prompt`` for a
                completion), or a prompt that does not fit the window:
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
        if self.needs_documents and not (isinstance(prompt, TaskPrompt) and prompt.passages):
            raise ApiError(
                400,
                f"{self.needs_documents}: send the passages as documents ([{{title, text}}], "
                "the question as the one user message) to /v1/chat/completions",
                param="documents" if param == "messages" else "prompt",
            )
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

    def ids_text(self, ids: list[int]) -> str:
        """The text of a token-id prompt (tokenizer).

        Raises:
            ApiError: a backend without a tokenizer here, an id outside the vocabulary, or ids
                of special tokens only (400, ``prompt``).
        """
        tokenizer = getattr(self.backend, "tokenizer", None)
        if not self.backend.has_tokenizer or tokenizer is None:
            raise ApiError(
                400,
                "a prompt of token ids needs the model's tokenizer, which this backend has not "
                "here: send the prompt as text",
                param="prompt",
            )
        size = len(tokenizer)
        for at, i in enumerate(ids):
            if not 0 <= i < size:
                raise ApiError(
                    400,
                    f"prompt[{at}] = {i} is not a token id of this model's vocabulary "
                    f"(0 to {size - 1})",
                    param="prompt",
                )
        text = self.backend.detokenize(ids)
        if not text:
            raise ApiError(
                400, "the prompt's token ids are special tokens only: no text", param="prompt"
            )
        return text

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
        """A queued streamed answer: its pieces as they are decoded (cut before the first
        newline after leading white space with ``stop``): a row of the running batch under
        continuous batching (its new text each step; its result the answer's
        :class:`Generation`), else ``Backend.stream`` run alone (its result what the stream
        returned: a remote model's token count, or ``None``)."""
        from ragfix.backends.base import cut_at_newline

        loop = asyncio.get_running_loop()
        if self.worker.continuous:
            job = Job(loop, prompt=prompt, key=(budget, stop, False), stream=True)
            self.worker.submit(job)
            return job
        job = Job(loop)

        def run(cancel: Cancel) -> int | None:
            pieces = self.backend.stream(
                prompt, max_new_tokens=budget, stop_at_newline=stop, cancel=cancel
            )
            if stop:
                pieces = cut_at_newline(pieces)
            with contextlib.closing(pieces):
                while True:
                    try:
                        piece = next(pieces)
                    except StopIteration as end:  # the answer's tokens, where the stream counts
                        return end.value
                    if piece:
                        job.emit(piece)

        job.run = run
        self.worker.submit(job)
        return job

    # ------------------------------------------------------------------ bodies
    def raw_text(self, gen: Generation, stop: bool) -> str:
        """The continuation as the model generated it (what a stream sends): the generated
        tokens decoded (a remote model's: the text its server returned), cut before the first
        newline after leading white space with the newline rule (tokenizer)."""
        from ragfix.backends.base import cut_at_newline

        if gen.token_ids is None and gen.raw_text is None:
            return gen.text
        text = gen.raw_text if gen.token_ids is None else self.backend.detokenize(gen.token_ids)
        return "".join(cut_at_newline(iter([text]))) if stop else text

    def token_texts(self, ids: list[int]) -> list[tuple[str, list[int]]]:
        """``(text, bytes)`` of each token: its own bytes, and their UTF-8 text with the bytes of
        a partial character written ``\\xNN`` (tokenizer)."""
        out = []
        for b in self.backend.token_bytes(ids):
            out.append((b.decode("utf-8", errors="backslashreplace"), list(b)))
        return out

    def top(self, gen: Generation, k: int) -> list[tuple[str, list[int], float]]:
        """The ``max(k, 1)`` most likely first tokens of ``gen``'s answer, most likely first, as
        ``(text, bytes, logprob)`` (tokenizer).

        Raises:
            ApiError: 400 when the backend gave no distribution (a remote model: its server's
                log-probabilities are not passed on).
        """
        if gen.first_logprobs is None:
            raise ApiError(
                400,
                f"logprobs: the model served here ({self.model_id}) gives no log-probabilities "
                "of its answers (a remote model: its server's are not passed on); ask without "
                "logprobs",
                param="logprobs",
            )
        values, ids = gen.first_logprobs.topk(max(k, 1))
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
            top = self.top(gen, k)
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
            "finish_reason": "length" if gen.own_tokens >= budget else "stop",
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
            parts: list[bytes] = []  # each token's bytes of the returned text
            values: list[float | None] = []
            tops: list[dict[str, float] | None] = []
            if scored is not None:
                ids, scores = scored
                raw = self.backend.token_bytes(ids)
                tokens = [_legacy(b) for b in raw]
                # a special token (a BOS read first) is echoed but is not in the text
                parts = [
                    b if self.backend.detokenize([i]) else b""
                    for i, b in zip(ids, raw, strict=True)
                ]
                values, tops = [None], [None]
                if scores is not None:
                    values += [float(v) for v in scores.logprobs]
                    names = self.backend.token_bytes(scores.top_ids.flatten().tolist())
                    k = scores.top_ids.shape[1]
                    for row, lps in enumerate(scores.top_logprobs.tolist()):
                        tops.append(_alternatives(names[row * k : (row + 1) * k], lps))
            if gen is not None:
                top = self.top(gen, req.logprobs)
                parts.append(bytes(top[0][1]))
                tokens, values = [*tokens, _legacy(bytes(top[0][1]))], [*values, top[0][2]]
                best = top[: req.logprobs]
                tops.append(_alternatives([bytes(b) for _, b, _ in best], [v for _, _, v in best]))
            logprobs = {
                "tokens": tokens,
                "token_logprobs": values,
                "top_logprobs": tops,
                "text_offset": _offsets(parts),
            }
        choice = {
            "index": 0,
            "text": (prompt if req.echo else "") + text,
            "logprobs": logprobs,
            "finish_reason": "length" if gen is None or gen.own_tokens >= budget else "stop",
        }
        counts = usage(gen) if gen is not None else usage_of(prompt_tokens, 0)
        return {**self.head("text_completion"), "choices": [choice], "usage": counts}

    async def events(
        self, job: Job, kind: str, prompt_tokens: int, budget: int, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE lines of a streamed answer (``data: {chunk}``, ``data: [DONE]``): the pieces as
        the model thread yields them, then a chunk with ``finish_reason`` (``length`` when the
        answer has ``max_tokens`` tokens: counted as decoded under continuous batching, as the
        remote model's server counted them, else the streamed text re-tokenized, or the
        budget when it ends inside a character) and,
        with ``include_usage``,
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
            ended = job.result.result()
            if isinstance(ended, Generation):
                n = ended.own_tokens
            elif isinstance(ended, int):  # counted by the stream (a remote model's server)
                n = ended
            elif text.endswith("\ufffd"):  # decoding stopped inside a character: at the budget
                n = budget
            else:
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
    return usage_of(gen.prompt_tokens, gen.own_tokens)


def _alternatives(tokens: list[bytes], logprobs: list[float]) -> dict[str, float]:
    """OpenAI's legacy ``top_logprobs`` entry: token text (:func:`_legacy`) -> log-probability,
    most likely first (of two tokens with one text, the likelier is kept)."""
    out: dict[str, float] = {}
    for t, v in zip(tokens, logprobs, strict=True):
        out.setdefault(_legacy(t), v)
    return out


def _legacy(token: bytes) -> str:
    """A token's text in OpenAI's legacy ``logprobs``: its UTF-8 text, or, for a token that
    holds part of a character, ``bytes:`` and its bytes written ``\\xNN``."""
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in token)


def _offsets(parts: list[bytes]) -> list[int]:
    """``text_offset`` of each token: the character (code point) of the text at which its
    bytes begin, ``parts`` being each token's bytes of the UTF-8 text in order; a token that
    begins inside a character gets that character's offset (OpenAI's legacy shape)."""
    out, chars = [], 0
    for part in parts:
        inside = bool(part) and part[0] & 0xC0 == 0x80  # a continuation byte first
        out.append(chars - 1 if inside else chars)
        chars += sum(1 for c in part if c & 0xC0 != 0x80)
    return out


__all__ = ["Server", "usage", "usage_of"]
