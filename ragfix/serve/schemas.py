"""The ``ragfix serve`` API: its request schemas and their checks (what a request may be, in
OpenAI's shapes; anything else is an :class:`~ragfix.serve_errors.ApiError` in OpenAI's error
format), and the reading of a request body into one (:func:`read_request`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ragfix.prompts import TaskPrompt, join_text_parts
from ragfix.serve_errors import ApiError
from ragfix.tasks import QA
from ragfix.types import Passage

#: answer budget of a request without ``max_tokens``
DEFAULT_MAX_TOKENS = 256
#: most alternatives per token a request may ask for
MAX_TOP_LOGPROBS = 20
#: largest request body accepted (bytes); a larger one is 413 before it is parsed
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: most ``documents`` a chat request may send (``ragfix serve --max-documents``)
DEFAULT_MAX_DOCUMENTS = 100
#: characters a prompt may have per token of the window: a longer prompt cannot fit (no token of
#: a usual vocabulary is longer; SmolLM2's longest is 81) and is refused before it is tokenized
MAX_CHARS_PER_TOKEN = 128
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


class ApiRequest(BaseModel):
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


class Document(BaseModel):
    """One retrieved passage of a chat request's ``documents`` (the field of Hugging Face chat
    templates, ``apply_chat_template(..., documents=[...])``, and of vLLM's OpenAI-compatible
    server): a ``text``, not empty, and an optional ``title``; other keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    title: str = ""
    text: str

    def passage(self) -> Passage:
        """The document as a :class:`~ragfix.types.Passage`."""
        return Passage(title=self.title, text=self.text)


class ChatRequest(ApiRequest):
    """A ``/v1/chat/completions`` request."""

    messages: list[Message]
    documents: list[Document] | None = None
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
        """See :meth:`ApiRequest.check_fields`; also ``max_tokens: 0`` and logprobs with stream.

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

    def prompt(self, max_documents: int = DEFAULT_MAX_DOCUMENTS) -> TaskPrompt:
        """The backend prompt: the user message, and the assistant message to continue; with
        ``documents``, the QA task's prompt (:data:`ragfix.tasks.QA`: Lost in the Middle's
        multi-document template) of the user message's question over the documents in the
        order sent, which knows where each passage is (:attr:`TaskPrompt.passages`).

        Raises:
            ApiError: any other shape of conversation; with ``documents``: none, more than
                ``max_documents``, one whose ``text`` is empty or white space (param
                ``documents.I.text``), or messages other than one user message with text.
        """
        roles = [m.role for m in self.messages]
        if self.documents is not None:
            return self._qa_prompt(roles, max_documents)
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

    def _qa_prompt(self, roles: list[str], max_documents: int) -> TaskPrompt:
        docs = self.documents or []
        if not docs:
            raise ApiError(400, "documents is empty: send at least one", param="documents")
        if len(docs) > max_documents:
            raise ApiError(
                400,
                f"documents holds {len(docs)} documents, more than this server's "
                f"{max_documents} (--max-documents)",
                param="documents",
            )
        for i, d in enumerate(docs):
            if not d.text.strip():
                raise ApiError(400, f"documents.{i}.text is empty", param=f"documents.{i}.text")
        if roles != ["user"] or self.continue_final_message:
            raise ApiError(
                400,
                "with documents, ragfix serve reads one user message, the question (the "
                "documents are put in the QA task's template, which has its own instruction): "
                "system messages, earlier turns and continue_final_message are not supported "
                f"(got roles {roles})",
                param="messages",
            )
        question = self.messages[0].text()
        if not question.strip():
            raise ApiError(400, "the user message (the question) is empty", param="messages")
        return QA.prompt(question, [d.passage() for d in docs])


class CompletionRequest(ApiRequest):
    """A ``/v1/completions`` request: a raw prompt, read as it is: a text, or token ids (what
    OpenAI's API, vLLM and lm-evaluation-harness's default ``tokenized_requests`` send)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_fields(self) -> None:
        """See :meth:`ApiRequest.check_fields`; also ``max_tokens: 0`` without ``echo``, and
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

    def text(self) -> str | list[int]:
        """The one prompt, not empty: its text, or its token ids.

        Raises:
            ApiError: several prompts, or an empty one.
        """
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return prompt


async def read_request(request, model: type[ApiRequest], limit: int) -> Any:
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


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_DOCUMENTS",
    "DEFAULT_MAX_TOKENS",
    "MAX_CHARS_PER_TOKEN",
    "MAX_TOP_LOGPROBS",
    "NEUTRAL",
    "ChatRequest",
    "CompletionRequest",
    "Document",
    "Message",
    "StreamOptions",
    "read_request",
]
