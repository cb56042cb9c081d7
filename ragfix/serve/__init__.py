"""An OpenAI-compatible HTTP server over any ragfix backend (what ``ragfix serve`` runs).

Any backend (vanilla, channel-scaled, gali, rope-scaled, truncated, any adapter) answers
``/v1/chat/completions`` (streaming and not, with ``logprobs``), ``/v1/completions`` (a raw
prompt, read as it is, with ``echo``), ``/v1/models`` and ``/health``, so an application in any
language, or ragfix itself (``--model openai:NAME --api-base http://HOST:PORT/v1``), can use a
debiased model. Built on FastAPI.

Its parts, one job each: :mod:`ragfix.serve.schemas` (the request schemas and their checks,
reading a body), :mod:`ragfix.serve.scheduler` (the model thread: queueing, batching,
cancellation), :mod:`ragfix.serve.server` (the served backend: window checks, model work,
response bodies), :mod:`ragfix.serve.app` (the routes: the FastAPI application, the API key) and
:mod:`ragfix.serve.process` (``ragfix serve`` as a subprocess); this package exports what they
make public.

How requests run: one model thread owns the backend (:class:`ModelWorker`, holding
``Server.lock`` while it has work). Where the backend decodes step by step
(:attr:`~ragfix.backends.base.Backend.supports_step_decoding`: vanilla and the methods that run
the model's own forward pass) answers are decoded with continuous batching
(:meth:`~ragfix.backends.base.Backend.decoder`): a request, streamed or not, whatever its
budget, stop rule and log-probability request, joins the running batch at the next decoding
step (prefilled alone as it joins), up to ``max_batch_size`` rows; a finished answer leaves the
batch at once. Each answer equals its answer alone. Elsewhere, answers with the same budget,
stop rule and log-probability request are batched whole (up to ``max_batch_size`` of them, the
first waiting at most ``max_wait_ms`` for company) where the backend
:attr:`~ragfix.backends.base.Backend.supports_batching`, else they run one at a time, and
streams run alone. Tokenizing (the window check, the response's token texts) happens in the
request's own thread under ``Server.tokenizer_lock``, never the model's. A client that goes
away, streaming or not, cancels its work: a queued request is dropped, a decoding row leaves
the batch within one step (a whole batch stops between steps once all its clients are gone:
:class:`~ragfix.backends.base.Cancel`).

Slow clients (:class:`~ragfix.serve_guard.ServeLimits`, run by
:func:`~ragfix.serve_guard.server_config`): a request's head must be in
within ``header_timeout_s`` and its body within ``body_timeout_s`` of its head, else it is
answered 408 ``request_timeout`` and its connection closed; a connection made while
``max_connections`` are open is answered 503 ``too_many_connections`` and closed before it is
read (:mod:`ragfix.serve_guard`), so trickling clients never hold the server's open files.

Passages as ``documents`` (Hugging Face chat templates' and vLLM's field): a chat request may
send its retrieved passages as ``documents: [{"title": ..., "text": ...}]`` (``title`` optional,
``text`` a non-empty string, no other keys, at most ``max_documents`` of them) with one user
message, the question; the server then builds the QA task's prompt (:data:`ragfix.tasks.QA`,
Lost in the Middle's multi-document template, the documents in the order sent), which knows
where each passage is. A backend that reads passages only where a task prompt says they are
(:func:`~ragfix.backends.base.plain_prompt_refusal`: ``attention-sort``, ``pine``,
``set-based``, ``calibrated-attention``) or answers over several orders of them
(:class:`~ragfix.backends.orders.OrderMarginalBackend`, ``--orders``) answers only such
requests; any other request to it is refused (400, param ``documents``; ``prompt`` for
``/v1/completions``).

What a request may be (anything else is refused with HTTP 400 in OpenAI's error format, one line):

* chat: one ``user`` message, optionally followed by an ``assistant`` message that the model
  continues (``continue_final_message: true``, ``add_generation_prompt: false``, vLLM's
  convention): the backend's :class:`~ragfix.prompts.TaskPrompt` (user turn in the chat
  template, assistant turn prefilled). System messages and earlier turns are not supported;
  with ``documents``, one user message only (the QA template has its own instruction);
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
(``unsupported_media_type``, :func:`~ragfix.serve.schemas.read_request`); a ``Host`` header
that names another host 403 (``host_not_allowed``, :class:`~ragfix.serve_guard.HostGate`, run by
:func:`~ragfix.serve_guard.server_config`); a request too slow 408 (``request_timeout``); a
connection over the limit 503 (``too_many_connections``); every error body is
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from ragfix.serve.app import API_KEY_ENV, KeyGate, check_api_key, create_app, exposure_warning
from ragfix.serve.process import free_port, serving
from ragfix.serve.scheduler import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_WAIT_MS, Job, ModelWorker
from ragfix.serve.schemas import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_DOCUMENTS,
    DEFAULT_MAX_TOKENS,
    MAX_CHARS_PER_TOKEN,
    NEUTRAL,
    ChatRequest,
    CompletionRequest,
    Document,
    Message,
)
from ragfix.serve.server import Server
from ragfix.serve_errors import ApiError

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_DOCUMENTS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_WAIT_MS",
    "MAX_CHARS_PER_TOKEN",
    "NEUTRAL",
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "Document",
    "Job",
    "KeyGate",
    "Message",
    "ModelWorker",
    "Server",
    "check_api_key",
    "create_app",
    "exposure_warning",
    "free_port",
    "serving",
]
