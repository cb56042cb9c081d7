"""A model served over HTTP by an OpenAI-compatible endpoint, behind the same model interface.

``load_backend("vanilla", model="openai:NAME", api_base=URL)`` gives a :class:`RemoteBackend`:
vLLM, llama.cpp's server, Ollama, TGI, a hosted API or ``ragfix serve`` answer the prompts of a
sweep, a pipeline sweep or a judge run. Requests go through the official ``openai`` client
(its async client for :meth:`RemoteBackend.generate`): up to ``concurrency`` at once, retried
with exponential backoff on 408, 409, 429 and 5xx and on connection errors (``max_retries``),
each bounded by ``timeout`` seconds. Ctrl-C cancels the requests in flight at once and hands back
the answers that had arrived (:class:`~ragfix.errors.Interrupted`). The API key is read from
``OPENAI_API_KEY`` (a local server needs none).

How prompts travel:

* a :class:`~ragfix.prompts.TaskPrompt` is a chat request with the user turn and, when it has an
  ``assistant_prefix``, an assistant message holding it, which the server is asked to continue
  (vLLM's ``continue_final_message=True, add_generation_prompt=False``, honoured by
  ``ragfix serve``): the model reads what a local backend reads. A server that ignores those
  fields answers after a closed assistant turn instead (see ``docs/remote.md``).
* a plain string (already chat-formatted, e.g. by :class:`~ragfix.llm.RagFixLLM`) goes to the
  completions endpoint as it is, as a local backend reads it.

Decoding is greedy (``temperature=0``); the newline stop rule is ``stop=["\\n"]``. With
``first_logprobs`` the server is asked for ``logprobs`` with the top
:data:`TOP_LOGPROBS` alternatives of each answer token; the first step's come back as
``Generation.first_top_logprobs`` (a server that returns none leaves it ``None``).

Token counts: with a ``tokenizer`` (the local name of the same model) prompts are counted here,
before they are sent, and the server's own count is compared: ``prompt_cut`` when the server
counted more than :data:`CUT_TOLERANCE` tokens fewer (it cut the prompt), else
``token_count_mismatch`` when they differ. Without one the server's ``usage`` figures are the
counts (a response without them is an error, never a guess), and consumers check the window after
the answer (:attr:`~ragfix.backends.base.Backend.has_tokenizer`). The window is
``context_window`` or the ``max_model_len`` the server reports in ``/v1/models`` (vLLM, ``ragfix
serve``). A prompt the server refuses as too long comes back flagged ``overflow`` with no answer.

A reasoning model's thinking (``<think>...</think>``) is dropped from every answer, and an
answer whose thinking never closed is flagged ``reasoning_unfinished``
(:func:`~ragfix.backends.base.final_answer`). An answer whose ``model`` field names another model
than the one asked for (:func:`same_model`: a dated snapshot or a ``:latest`` tag of it is the
same) is flagged ``served_model_mismatch`` with the name it came with; text that is not valid
Unicode (lone UTF-16 surrogates) is replaced by U+FFFD and flagged ``invalid_text``, wherever
the server sends it (answers, their top alternatives, ``/v1/models``, error messages). All three
are left out of the accuracy (:data:`~ragfix.types.UNSCORED`).

Answers the server gave no text for (``content: null``, as reasoning models answer in
``reasoning_content``; a blank one; a refusal) come back flagged ``empty_answer``, the server's
reason in :attr:`Generation.reasons`. A response that is an ``{"error": ...}`` body or has no
choices (both with HTTP 200) is a one-line :class:`~ragfix.errors.RagfixError` naming the
endpoint and the server's message.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import torch
from pydantic import Field, field_validator

from ragfix.backends.base import (
    Backend,
    BackendOptions,
    Cancel,
    Prompt,
    answer_rules,
    check_cancel,
    final_answer,
    validated_options,
)
from ragfix.backends.hf import chat_text, template_id
from ragfix.errors import ConfigError, Interrupted, ModelNotFoundError, RagfixError
from ragfix.models.load import load_tokenizer
from ragfix.models.resolve import REMOTE_PREFIX
from ragfix.types import (
    EMPTY_ANSWER,
    INVALID_TEXT,
    OVERFLOW,
    PROMPT_CUT,
    REASONING_UNFINISHED,
    SERVED_MODEL_MISMATCH,
    TOKEN_COUNT_MISMATCH,
    Generation,
)

#: alternatives asked for per answer token with ``first_logprobs`` (the most OpenAI allows)
TOP_LOGPROBS = 20
#: prompt tokens the server may count fewer than the tokenizer here without having cut the
#: prompt (a BOS token or a chat template's closing newline counted on one side only); more
#: fewer is a cut prompt (``prompt_cut``, not scored). More tokens there are never a cut (vLLM's
#: completions endpoint adds the BOS token: one more)
CUT_TOLERANCE = 2
#: characters of a server's refusal kept in the reason of an ``empty_answer`` flag
REFUSAL_CHARS = 80
#: the environment variable holding the API key
API_KEY_ENV = "OPENAI_API_KEY"
#: fields of a ``/v1/models`` entry that describe the served model: its id, owner, the checkpoint
#: it was loaded from (vLLM's ``root``), its window, llama.cpp's ``meta`` (vocabulary, sizes,
#: parameters) and the served backend's identity (``ragfix serve``); the ``created`` timestamp and
#: permission ids, which change between server starts, are left out
SERVER_MODEL_FIELDS = (
    "id",
    "owned_by",
    "root",
    "max_model_len",
    "meta",
    "ragfix",
    "ragfix_needs_documents",
)
#: how servers word a prompt longer than the window (OpenAI, vLLM, llama.cpp, TGI)
_TOO_LONG = re.compile(
    r"context[_ ]length|maximum context|context window|exceeds? the available context|"
    r"input validation error: `inputs` tokens",
    re.IGNORECASE,
)


#: what may follow the asked model's name in the name a server answers with and still name the
#: same model: a dated snapshot (OpenAI's ``gpt-4o-2024-08-06``), a version (``-v2``,
#: ``-0125``) or Ollama's ``:latest`` tag
_SAME_MODEL_TAIL = re.compile(r"[-:@](\d{4}-?\d{2}-?\d{2}|\d{4}|v?\d+(\.\d+)*|latest)")


def same_model(asked: str, answered: str) -> bool:
    """Whether a server that was asked for model ``asked`` and answered as ``answered`` answered
    with the same model: the same name, or ``asked`` followed by one of
    :data:`_SAME_MODEL_TAIL` (``gpt-4o`` -> ``gpt-4o-2024-08-06``, ``llama3`` -> ``llama3:latest``;
    not ``gpt-4o`` -> ``gpt-4o-mini``)."""
    if answered == asked:
        return True
    tail = answered.removeprefix(asked)
    return tail != answered and _SAME_MODEL_TAIL.fullmatch(tail) is not None


def valid_text(text: str) -> tuple[str, int]:
    """``text`` with every lone UTF-16 surrogate (which JSON can carry as ``\\ud800`` and no
    UTF-8 file can hold) replaced by U+FFFD, and how many there were."""
    bad = sum(0xD800 <= ord(c) <= 0xDFFF for c in text)
    if not bad:
        return text, 0
    return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text), bad


def _valid(value):
    """``value`` (a JSON document) with its strings made :func:`valid_text`."""
    if isinstance(value, str):
        return valid_text(value)[0]
    if isinstance(value, dict):
        return {_valid(k): _valid(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_valid(v) for v in value]
    return value


class RemoteOptions(BackendOptions):
    """Settings of a remote model (``--api-base``, ``--tokenizer``, ``--context-window``,
    ``--concurrency``, ``--max-retries``, ``--timeout``).

    Attributes:
        api_base: the endpoint's base URL, e.g. ``http://127.0.0.1:8000/v1``.
        tokenizer: local name of the same model (``smollm2``, a hub id, a folder) whose tokenizer
            counts prompt tokens and formats prompts; ``None``: the server's usage figures count.
        context_window: prompt plus answer tokens the server accepts; ``None``: what the server
            reports (``max_model_len``).
        concurrency: requests in flight at once (>= 1).
        max_retries: retries of a request after 408, 409, 429, 5xx or a connection error, with
            exponential backoff (0.5 s doubling to 8 s, or the server's ``Retry-After``).
        timeout: seconds a request may take before it is retried.
    """

    #: where the server is and how it is called, never what it answers: a server restarted on
    #: another address serves the same model (its id and what it reports count, in identity())
    call_settings: ClassVar[frozenset[str]] = frozenset(
        {"api_base", "concurrency", "max_retries", "timeout"}
    )

    api_base: str
    tokenizer: str | None = None
    context_window: int | None = Field(default=None, gt=0)
    concurrency: int = Field(default=4, ge=1)
    max_retries: int = Field(default=5, ge=0)
    timeout: float = Field(default=120.0, gt=0)

    @field_validator("api_base")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"https?://[^/\s]+", v):
            raise ValueError(f"{v!r} is not an http:// or https:// URL")
        return v.rstrip("/")


def _merge_top(pairs: list[tuple[str, float]]) -> dict[str, float]:
    """``{token text: log-probability}``; tokens with the same text (different ids) are summed
    (log-sum-exp); texts made :func:`valid_text` (a token can be part of a character)."""
    out: dict[str, float] = {}
    for raw, lp in pairs:
        text = valid_text(raw)[0]
        if text in out:
            hi = max(out[text], lp)
            lp = hi + math.log(math.exp(out[text] - hi) + math.exp(lp - hi))
        out[text] = lp
    return out


class RemoteBackend(Backend):
    """A model behind an OpenAI-compatible endpoint (see the module docstring).

    Args:
        model: the served model's id (``NAME`` of ``openai:NAME``).
        options: validated :class:`RemoteOptions` (as :func:`ragfix.backends.load_backend`
            passes them), or None to validate ``**kwargs``.
        **kwargs: :class:`RemoteOptions` as keywords (when ``options`` is None).

    Raises:
        pydantic.ValidationError: an unknown or invalid option.
        RagfixError: the endpoint cannot be reached or refuses the key.
        ModelNotFoundError: the server does not serve ``model``, or the tokenizer cannot be found.
        ConfigError: ``context_window`` larger than the window the server reports.
    """

    name: ClassVar[str] = "vanilla"
    options_model: ClassVar[type[BackendOptions]] = RemoteOptions
    supports_prefix_reuse = False

    def __init__(self, model: str, options: RemoteOptions | None = None, **kwargs):
        from openai import OpenAI

        self.options = validated_options(RemoteOptions, options, kwargs)
        self.served = model
        self.tokenizer = load_tokenizer(self.options.tokenizer) if self.options.tokenizer else None
        self.has_tokenizer = self.tokenizer is not None
        self.preferred_batch_size = self.options.concurrency
        self.client = OpenAI(**self._client_settings())
        self.server_model = self._server_model()
        needs = self.server_model.get("ragfix_needs_documents")
        if needs:
            raise ConfigError(
                f"{self.options.api_base} serves {model!r} only to chat requests that send their "
                f"passages as documents ({needs}); ragfix's runs send the task's prompt: serve "
                "the model without --orders (give --orders to this run) or with a backend that "
                "reads plain prompts"
            )
        reported = self.server_model.get("max_model_len")
        given = self.options.context_window
        if given and isinstance(reported, int) and given > reported:
            raise ConfigError(
                f"--context-window {given} is larger than the {reported} tokens the server at "
                f"{self.options.api_base} reports for {model!r}"
            )

    # ------------------------------------------------------------------ errors
    def _failed(self, e: Exception) -> RagfixError:
        """One-line error for a request that failed for good (after the client's retries); the
        server's words made :func:`valid_text`."""
        return RagfixError(valid_text(str(self._failure(e)))[0])

    def _failure(self, e: Exception) -> RagfixError:
        """See :meth:`_failed`."""
        import openai

        where = f"{self.options.api_base} ({self.served})"
        if isinstance(e, openai.APIConnectionError):
            return RagfixError(
                f"cannot reach {where} after {self.options.max_retries} retries "
                f"({type(e).__name__}); finished results are saved: rerun to resume"
            )
        if isinstance(e, openai.APIStatusError):
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            if e.status_code in (401, 403):
                return RagfixError(f"{where} refused the API key (set ${API_KEY_ENV}): {msg}")
            again = e.status_code in (408, 409, 429) or e.status_code >= 500
            saved = "; finished results are saved: rerun to resume"
            tail = f" after {self.options.max_retries} retries{saved}" if again else ""
            held = _not_retried(e.response.headers) if again else None
            if held:
                tail = f", {held}{saved}"
            return RagfixError(f"{where} answered HTTP {e.status_code}{tail}: {msg}")
        return RagfixError(f"{where}: {type(e).__name__}: {str(e).strip().splitlines()[0]}")

    def _needs_tokenizer(self, what: str) -> RagfixError:
        return RagfixError(
            f"{self.model_name}: {what} needs the model's tokenizer: give --tokenizer NAME "
            "(the local name of the same model, e.g. smollm2 or a hub id)"
        )

    def _no_scores(self, what: str) -> RagfixError:
        return RagfixError(
            f"{self.model_name}: {what} needs the model's full next-token distribution, which an "
            f"OpenAI-compatible server does not give (only the top {TOP_LOGPROBS} log-"
            "probabilities of generated tokens): use a local model"
        )

    def _server_model(self) -> dict:
        """The served model's entry of ``/v1/models`` (its describing fields only).

        Raises:
            ModelNotFoundError: the server lists models, but not this one.
        """
        import openai

        try:
            listed = [m.model_dump() for m in self.client.models.list()]
        except openai.NotFoundError:  # a server without /v1/models
            return {}
        except openai.APIError as e:
            raise self._failed(e) from None
        entry = next((m for m in listed if m.get("id") == self.served), None)
        if entry is None:
            served = ", ".join(str(m.get("id")) for m in listed[:20]) or "none"
            raise ModelNotFoundError(
                f"{self.options.api_base} does not serve {self.served!r} (it serves: {served})"
            )
        return {k: _valid(entry[k]) for k in SERVER_MODEL_FIELDS if entry.get(k) is not None}

    # ------------------------------------------------------------------ what it is
    @property
    def model_name(self) -> str:
        """``openai:NAME``."""
        return REMOTE_PREFIX + self.served

    @property
    def context_window(self) -> int:
        """``context_window`` if given, else the ``max_model_len`` the server reports.

        Raises:
            ConfigError: neither is known.
        """
        window = self.options.context_window or self.server_model.get("max_model_len")
        if not isinstance(window, int):
            raise ConfigError(
                f"the server at {self.options.api_base} does not report the context window of "
                f"{self.served!r}: give --context-window N"
            )
        return window

    @property
    def endpoint(self) -> str:
        """The server's base URL (``api_base``)."""
        return self.options.api_base

    def identity(self) -> dict:
        """The served model's id and what the server says about it (:data:`SERVER_MODEL_FIELDS`;
        for ``ragfix serve``: the served backend's own identity, weights fingerprint included),
        the options that change answers, and the tokenizer's chat template if one is given. The
        endpoint (:attr:`endpoint`) and the call settings are left out: the same server restarted
        at another address, or called with other retries, has the same identity."""
        return {
            "model": {
                "name": self.model_name,
                "server": self.server_model,
            },
            "backend": self.name,
            "options": self.options.model_dump(
                mode="json", exclude=set(self.options.call_settings)
            ),
            "chat_template": template_id(self.tokenizer) if self.tokenizer else "the server's",
        }

    # ------------------------------------------------------------------ text and tokens
    def format_prompt(self, prompt: Prompt) -> str:
        """The text the model reads (the tokenizer's chat template for a
        :class:`~ragfix.prompts.TaskPrompt`; a string as it is).

        Raises:
            RagfixError: a ``TaskPrompt`` without a tokenizer.
        """
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise self._needs_tokenizer("formatting a prompt")
        return chat_text(self.tokenizer, prompt, bos=False)  # the server puts its own BOS

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens).

        Raises:
            RagfixError: no tokenizer was given.
        """
        if self.tokenizer is None:
            raise self._needs_tokenizer("counting tokens")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens.

        Raises:
            RagfixError: no tokenizer was given.
        """
        if self.tokenizer is None:
            raise self._needs_tokenizer("decoding tokens")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ requests
    def _client_settings(self) -> dict:
        """The ``openai`` client's settings (the sync client's and each ``generate`` call's async
        one)."""
        return {
            "base_url": self.options.api_base,
            "api_key": os.environ.get(API_KEY_ENV) or "none",
            "max_retries": self.options.max_retries,
            "timeout": self.options.timeout,
        }

    def _request(self, client, prompt: Prompt, max_new_tokens: int, stop: bool, **extra):
        """One chat (``TaskPrompt``) or completions (string) request through ``client`` (the
        sync or the async ``openai`` client: the response, or a coroutine of it); ``extra`` are
        more fields of the request (``stream``, log-probabilities)."""
        common = {
            "model": self.served,
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "stop": ["\n"] if stop else None,
            **extra,
        }
        if isinstance(prompt, str):
            return client.completions.create(prompt=prompt, **common)
        messages = [{"role": "user", "content": prompt.user}]
        if prompt.assistant_prefix:
            messages.append({"role": "assistant", "content": prompt.assistant_prefix})
            common["extra_body"] = {"continue_final_message": True, "add_generation_prompt": False}
        return client.chat.completions.create(messages=messages, **common)

    def _choice(self, resp, what: str):
        """The first choice of a response.

        Raises:
            RagfixError: an ``{"error": ...}`` body (HTTP 200) or no choices (``choices: null``
                or ``[]``): one line naming the endpoint and the server's message.
        """
        where = f"{self.options.api_base} ({self.served})"
        error = (resp.model_extra or {}).get("error")
        if error is not None:
            msg = error.get("message", error) if isinstance(error, dict) else error
            first = str(msg).strip().splitlines()[0] if str(msg).strip() else "no message"
            raise RagfixError(
                f"{where} answered a {what} request (HTTP 200) with an error: {first}"
            )
        if not getattr(resp, "choices", None):
            raise RagfixError(
                f"{where} answered a {what} request without choices "
                f"(choices: {json.dumps(getattr(resp, 'choices', None))}); nothing to read"
            )
        return resp.choices[0]

    async def _answer(
        self, client, prompt: Prompt, max_new_tokens: int, stop: bool, logprobs: bool
    ) -> Generation:
        """One greedy answer as a :class:`Generation` (see :meth:`generate`), through the async
        ``client``."""
        import openai

        start = time.perf_counter()
        local = len(self.encode(prompt)) if self.tokenizer is not None else None
        extra = {}
        if logprobs:
            extra = (
                {"logprobs": TOP_LOGPROBS}
                if isinstance(prompt, str)
                else {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
            )
        try:
            resp = await self._request(client, prompt, max_new_tokens, stop, **extra)
        except openai.BadRequestError as e:
            if not _TOO_LONG.search(f"{e.code or ''} {e}"):
                raise self._failed(e) from None
            return Generation(
                text="",
                prompt_tokens=-1 if local is None else local,
                new_tokens=0,
                prefill_tokens=0,
                seconds=time.perf_counter() - start,
                flags=[OVERFLOW],
            )
        except openai.APIError as e:
            raise self._failed(e) from None
        completions = isinstance(prompt, str)
        choice = self._choice(resp, "completions" if completions else "chat")
        raw = choice.text if completions else choice.message.content
        raw, invalid = valid_text(raw) if raw else (raw, 0)
        given = getattr(resp, "usage", None)
        counts = {k: getattr(given, k, None) for k in ("prompt_tokens", "completion_tokens")}
        usage = counts if all(isinstance(v, int) for v in counts.values()) else None
        if local is None and usage is None:
            what = "no usage figures" if given is None else f"usage without a count ({counts})"
            raise RagfixError(
                f"{self.options.api_base} reported {what} for {self.served!r}, so the prompt's "
                "tokens cannot be counted: give --tokenizer NAME"
            )
        text, reasons = final_answer(raw or "", stop)
        if invalid:
            reasons[INVALID_TEXT] = (
                f"{invalid} lone UTF-16 surrogate(s) in the server's answer, not text "
                "(each replaced by U+FFFD)"
            )
        answered = getattr(resp, "model", None)
        if isinstance(answered, str) and answered and not same_model(self.served, answered):
            reasons[SERVED_MODEL_MISMATCH] = (
                f"the server answered as {valid_text(answered)[0]!r}, asked for {self.served!r}"
            )
        flags = list(reasons)
        if local is not None and usage is not None and usage["prompt_tokens"] != local:
            cut = usage["prompt_tokens"] < local - CUT_TOLERANCE
            flags.append(PROMPT_CUT if cut else TOKEN_COUNT_MISMATCH)
            if cut:
                reasons[PROMPT_CUT] = (
                    f"the server counted {usage['prompt_tokens']} prompt tokens, {local} here"
                )
        if not text and REASONING_UNFINISHED not in flags:
            flags.append(EMPTY_ANSWER)
            reasons[EMPTY_ANSWER] = _why_empty(choice, raw, completions)
        n_prompt = usage["prompt_tokens"] if local is None else local
        return Generation(
            text=text,
            prompt_tokens=n_prompt,
            new_tokens=usage["completion_tokens"] if usage else len(self.tokenize(raw or "")),
            prefill_tokens=n_prompt,
            seconds=time.perf_counter() - start,
            first_top_logprobs=_first_top(choice.logprobs, completions) if logprobs else None,
            usage=usage,
            raw_text=raw or "",
            flags=flags,
            reasons=reasons,
        )

    async def _each(self, items: list, work, cancel: Cancel | None) -> tuple[list | None, dict]:
        """``await work(client, item)`` for every item, ``concurrency`` requests in flight at
        once: ``(results, {})``; ``cancel`` is asked before each request is sent
        (:class:`~ragfix.errors.Cancelled`); when cancelled (Ctrl-C), every request in flight is
        cancelled at once and the results that had arrived come back by item index:
        ``(None, {index: result})``. A request that fails for good cancels the others and its
        error is raised."""
        from openai import AsyncOpenAI

        gate = asyncio.Semaphore(self.options.concurrency)

        async def one(client, item):
            async with gate:
                check_cancel(cancel)
                return await work(client, item)

        async with AsyncOpenAI(**self._client_settings()) as client:
            tasks = [asyncio.ensure_future(one(client, item)) for item in items]
            try:
                return list(await asyncio.gather(*tasks)), {}
            except BaseException as e:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if not isinstance(e, asyncio.CancelledError):
                    raise
                arrived = {
                    i: t.result()
                    for i, t in enumerate(tasks)
                    if not t.cancelled() and t.exception() is None
                }
                return None, arrived

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        batch_size: int = 8,
        max_new_tokens: int | None = None,
        stop_at_newline: bool | None = None,
        first_logprobs: bool = False,
        prefix_reuse: bool = False,
        cancel: Cancel | None = None,
    ) -> list[Generation]:
        """Greedy answers (see :meth:`Backend.generate`), ``concurrency`` requests in flight at
        once (``batch_size`` and ``prefix_reuse`` do not apply: the server batches and caches
        as it does). With ``first_logprobs`` each answer's ``first_top_logprobs`` holds the top
        :data:`TOP_LOGPROBS` alternatives of its first token (``first_logprobs`` stays None).
        ``cancel`` is asked before each request is sent (a request in flight runs to its end).

        An answer without text is flagged ``empty_answer`` with the server's reason in
        ``reasons``; a prompt the server counted at more than :data:`CUT_TOLERANCE` tokens fewer
        than the tokenizer here is flagged ``prompt_cut`` (fewer or more within that:
        ``token_count_mismatch``).

        Raises:
            RagfixError: a request failed for good (after its retries), the server answered an
                error body or no choices, or it reported no usage figures and no tokenizer was
                given.
            Cancelled: ``cancel`` was set before every request was sent.
            Interrupted: Ctrl-C (in the main thread): the requests in flight are cancelled at
                once; ``done`` holds the answers that had arrived, by prompt index.
        """
        jobs = [(p, *answer_rules(p, max_new_tokens, stop_at_newline)) for p in prompts]
        if not jobs:
            return []
        answers, arrived = _run(
            self._each(jobs, lambda client, job: self._answer(client, *job, first_logprobs), cancel)
        )
        if answers is None:
            raise Interrupted(done=arrived)
        return answers

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 256,
        stop_at_newline: bool = False,
        cancel: Cancel | None = None,
    ) -> Iterator[str]:
        """Yield the greedy answer to one prompt as the server streams it (pieces made
        :func:`valid_text`; the text as generated, a reasoning model's thinking included: only
        :meth:`generate` applies :func:`~ragfix.backends.base.final_answer`); closing the
        iterator, or ``cancel`` (asked at each event), closes the connection (the server stops
        generating). The stream asks for its usage (``stream_options.include_usage``) and
        returns (``StopIteration.value``) the answer's tokens as the server counted them
        (``usage.completion_tokens``), ``None`` when it gave none.

        Raises:
            RagfixError: the request failed for good.
            Cancelled: ``cancel`` was set before the answer was complete.
        """
        import openai

        try:
            events = self._request(
                self.client,
                prompt,
                max_new_tokens,
                stop_at_newline,
                stream=True,
                stream_options={"include_usage": True},
            )
        except openai.APIError as e:
            raise self._failed(e) from None
        tokens = None
        try:
            for ev in events:
                check_cancel(cancel)
                if getattr(ev, "usage", None) is not None:
                    tokens = ev.usage.completion_tokens
                if not ev.choices:
                    continue
                c = ev.choices[0]
                piece = c.text if isinstance(prompt, str) else c.delta.content
                if piece:
                    yield valid_text(piece)[0]
        finally:
            events.close()
        return tokens

    # ------------------------------------------------------------------ scoring
    def next_token_logprobs(self, prompts: Sequence[Prompt], *, batch_size: int = 8):
        """Not available from a server.

        Raises:
            RagfixError: always (names what needs it).
        """
        raise self._no_scores("next_token_logprobs")

    def loglikelihood(self, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
        """Summed log-probability (nats) of each continuation after its context, as the server
        scores the text ``format_prompt(context) + continuation``: completions requests with
        ``echo``, ``logprobs: 1`` and ``max_tokens: 1`` (what lm-evaluation-harness's
        ``local-completions`` sends; vLLM and ``ragfix serve`` answer it), one for the whole
        text and one for each distinct context. Read by token count, as lm-eval reads: the
        whole text's echoed prompt tokens (``usage.prompt_tokens`` of them) after the context's
        count are the continuation's. So a BOS token the server echoes first, and token texts
        that are not the text's characters (vLLM's ``text_offset`` adds each token string's
        length, a byte token's included), change nothing. ``concurrency`` requests in flight.

        Raises:
            ValueError: an empty continuation.
            RagfixError: a :class:`TaskPrompt` context without ``--tokenizer`` (the chat text is
                formatted here), a request failed for good, the server did not score the
                prompt's tokens (no ``echo`` log-probabilities, fewer than its
                ``usage.prompt_tokens``, or no ``usage``), or its tokens of the whole text do
                not begin with the context's (one token read across the end of the context:
                the continuation's score would hold part of the context's).
        """
        texts = []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("loglikelihood needs a non-empty continuation")
            texts.append((self.format_prompt(context), continuation))
        contexts: dict[str, asyncio.Future] = {}

        async def score(client, item: tuple[str, str]) -> float:
            context, continuation = item
            if context not in contexts:
                contexts[context] = asyncio.ensure_future(self._echo(client, context))
            (tokens, values), (head, _) = await asyncio.gather(
                self._echo(client, context + continuation), contexts[context]
            )
            if tokens[: len(head)] != head or len(tokens) <= len(head):
                raise RagfixError(
                    f"{self.options.api_base} ({self.served}) reads one token across the end "
                    f"of the context (character {len(context)}): its tokens of the whole text "
                    "do not begin with the context's; a continuation is scored from a token "
                    "boundary (begin it with a space or a new line)"
                )
            return float(sum(values[len(head) - 1 :]))

        scores, arrived = _run(self._each(texts, score, None))
        if scores is None:
            raise Interrupted(done=arrived)
        return scores

    async def _echo(self, client, text: str) -> tuple[list[str], list[float]]:
        """The server's prompt tokens of ``text`` (their token strings) and the log-probability
        of each after the first (``[n]`` and ``[n - 1]``), from one completions request with
        ``echo``, ``logprobs: 1`` and ``max_tokens: 1`` (``0``, which OpenAI's API, vLLM and
        ``ragfix serve`` take with ``echo``, when the text alone fills the window); ``n`` is
        the response's ``usage.prompt_tokens``.

        Raises:
            RagfixError: the request failed for good, or the server did not score the prompt's
                tokens (see :meth:`loglikelihood`).
        """
        import openai

        async def echo(budget: int):
            return await client.completions.create(
                model=self.served, prompt=text, max_tokens=budget, temperature=0, echo=True,
                logprobs=1,
            )  # fmt: skip

        try:
            try:
                resp = await echo(1)
            except openai.BadRequestError as e:  # the text fills the window: no answer token
                if not _TOO_LONG.search(f"{e.code or ''} {e}"):
                    raise
                resp = await echo(0)
        except openai.APIError as e:
            raise self._failed(e) from None
        lp = self._choice(resp, "completions echo").logprobs
        tokens = list(getattr(lp, "tokens", None) or [])
        values = list(getattr(lp, "token_logprobs", None) or [])
        n = getattr(getattr(resp, "usage", None), "prompt_tokens", None)
        where = f"{self.options.api_base} ({self.served})"
        if n is None:
            raise RagfixError(
                f"{where} gave no usage.prompt_tokens with its echo: where the prompt's tokens "
                "end cannot be read, so answers cannot be scored (score-max, the answer-style "
                "judge); use --orders-aggregate max or plurality"
            )
        scored = values[1:n]
        if len(tokens) < n or len(values) < n or not scored or None in scored:
            some = "some" if any(v is not None for v in scored) else "any"
            raise RagfixError(
                f"{where} gave no log-probability for {some} of the "
                "prompt's tokens (completions with echo and logprobs): it cannot score answers, "
                "which score-max and the answer-style judge need (llama.cpp's server ignores "
                "echo; use --orders-aggregate max or plurality, or serve the model with vLLM or "
                "ragfix serve)"
            )
        return tokens[:n], [float(v) for v in scored]

    def token_scores(self, ids: Sequence[int], top: int):
        """Not available from a server (``ragfix serve`` over a remote model scoring ``echo``).

        Raises:
            RagfixError: always (names what needs it).
        """
        raise self._no_scores("scoring text (echo with logprobs)")

    def token_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """Not available from a server (perplexity, ``loglikelihood`` and calibration need it).

        Raises:
            RagfixError: always (names what needs it).
        """
        raise self._no_scores("scoring text (perplexity, loglikelihood, calibration)")


def _not_retried(headers) -> str | None:
    """Why the ``openai`` client did not retry a retryable answer with these ``headers``, in
    words, or ``None`` when it retried: ``x-should-retry: false``, or a ``Retry-After`` (or
    ``retry-after-ms``; seconds or an HTTP date) longer than the two minutes it waits."""
    from email.utils import parsedate_to_datetime

    from openai._constants import MAX_RETRY_AFTER_DELAY

    if headers.get("x-should-retry") == "false":
        return "not retried (the server said x-should-retry: false)"
    wait = None
    for name, unit in (("retry-after-ms", 1000), ("retry-after", 1)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            wait = float(value) / unit
        except ValueError:
            try:
                wait = parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError):
                continue
        break
    if wait is None or not math.isfinite(wait) or wait <= MAX_RETRY_AFTER_DELAY:
        return None
    minutes = f"{wait / 3600:.1f} h" if wait >= 3600 else f"{wait / 60:.0f} min"
    return (
        f"which asked to be retried in {minutes} (Retry-After), longer than the "
        f"{MAX_RETRY_AFTER_DELAY // 60} min a client waits: not retried"
    )


def _run(coro):
    """Run ``coro`` to its end: in this thread (Ctrl-C in the main thread cancels it), or in a
    helper thread when this thread already runs an event loop (a notebook; Ctrl-C there waits
    for the requests in flight)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _why_empty(choice, raw: str | None, completions: bool) -> str:
    """What the server said about an answer without text, comma-separated: ``content null`` or
    ``content blank``, its ``finish_reason``, a ``reasoning_content`` (or ``reasoning``) field
    that holds text, a ``refusal`` (its first line)."""
    said = ["content null" if raw is None else "content blank"]
    if choice.finish_reason:
        said.append(f"finish_reason {choice.finish_reason}")
    if not completions:
        message = choice.message
        fields = {**(message.model_extra or {})}
        for name in ("reasoning_content", "reasoning"):
            if fields.get(name):
                said.append(f"{name} present")
        refusal = getattr(message, "refusal", None)
        if refusal:
            first = str(refusal).strip().splitlines()[0]
            said.append(f"refusal: {first[:REFUSAL_CHARS]}")
    return ", ".join(said)


def _first_top(logprobs, completions: bool) -> dict[str, float] | None:
    """The first answer token's top alternatives ``{text: log-probability}`` from a response's
    ``logprobs`` (chat: ``content[0].top_logprobs``; completions: ``top_logprobs[0]``), or
    ``None`` when the server returned none."""
    if logprobs is None:
        return None
    if completions:
        tops = logprobs.top_logprobs or []
        return _merge_top(list(tops[0].items())) if tops and tops[0] else None
    content = logprobs.content or []
    if not content:
        return None
    first = content[0]
    pairs = [(t.token, t.logprob) for t in first.top_logprobs or []]
    return _merge_top(pairs or [(first.token, first.logprob)])


__all__ = [
    "API_KEY_ENV",
    "CUT_TOLERANCE",
    "TOP_LOGPROBS",
    "RemoteBackend",
    "RemoteOptions",
    "same_model",
    "valid_text",
]
