"""A backend answering one prompt for a framework's LLM component: one place, framework-neutral.

:class:`AnswerFields` holds the settings (pydantic fields, unknown ones refused); the LLM
components of each framework declare them by inheriting it: :class:`ragfix.llm.RagFixLLM`
(LlamaIndex), :class:`ragfix.integrations.langchain.RagFixChatModel` (LangChain) and
:class:`ragfix.integrations.haystack.RagFixChatGenerator` (Haystack, through
:class:`AnswerSettings`). :class:`Answerer` checks them against the backend once, wraps a prompt
in the model's chat template, refuses one that does not fit the window, and answers greedily
(whole, or streamed piece by piece); it keeps the last prompt exactly as the model read it.

A framework's prompt is plain text: it does not say where its passages are. Given a
:class:`PassageSource` (``passages_from=``: the correction component that passed the documents
on), :class:`Answerer` finds the source's last documents in each prompt
(:func:`ragfix.prompts.find_passages`) and hands the backend a
:class:`~ragfix.prompts.TaskPrompt` with their spans, so a backend that reads passages where the
prompt says they are (order marginalization, ``pine``, ``set-based``:
:attr:`~ragfix.backends.base.Backend.needs_passage_spans`) answers a framework's prompt.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from ragfix.backends.base import Backend, Prompt, cut_at_newline, require_plain_prompts
from ragfix.errors import ConfigError
from ragfix.prompts import TaskPrompt, find_passages
from ragfix.types import Generation


@runtime_checkable
class PassageSource(Protocol):
    """A component that passes documents on to a framework's prompt and says which: the
    correction components :class:`ragfix.postprocessor.RagFixPostprocessor`,
    :class:`ragfix.integrations.langchain.RagFixCompressor` and
    :class:`ragfix.integrations.haystack.RagFixRanker`.

    Attributes:
        last_passages: the documents it last passed on, in the order passed on, each as the
            framework's prompt renders it (``Document (Title: t) text``, the bare text without
            a title: :func:`ragfix.tasks.render_chunk`); ``None`` before its first run and
            after a run that raised.
    """

    @property
    def last_passages(self) -> list[str] | None: ...


class AnswerFields(BaseModel):
    """The settings of an LLM component over a backend (a mixin for the framework components).

    Attributes:
        max_new_tokens: generation budget in tokens.
        context_window: tokens (prompt plus answer) the framework may fill; default: the
            backend's :attr:`~ragfix.backends.Backend.context_window`. A larger value is clamped
            to the backend's window with a ``UserWarning``.
        stop_at_newline: cut the answer at its first newline (short-answer QA).
        use_chat_template: wrap the prompt in the model's chat template.
        prefix_reuse: reuse the KV cache of the common token prefix with the previous prompt
            (only for backends that allow it, see :attr:`Backend.supports_prefix_reuse`). Same
            greedy answers up to floating-point noise, fewer prefill tokens when prompts share a
            head.
    """

    max_new_tokens: int = Field(default=256, gt=0, description="tokens to generate at most")
    context_window: int | None = Field(
        default=None, gt=0, description="prompt + answer tokens; default: the backend's window"
    )
    stop_at_newline: bool = Field(default=False, description="cut the answer at a newline")
    use_chat_template: bool = Field(default=True, description="wrap prompts in the chat template")
    prefix_reuse: bool = Field(default=False, description="reuse the KV cache of shared prefixes")

    def answer_settings(self) -> dict:
        """The answer settings alone (the fields of this mixin), as a dict."""
        return {k: getattr(self, k) for k in AnswerFields.model_fields}


class AnswererView:
    """What a framework component over an :class:`Answerer` (its private ``_answerer``) shows:
    the backend, the last prompt and generation, and the number of model calls."""

    @property
    def backend(self) -> Backend:
        """The backend that answers."""
        return self._answerer.backend

    @property
    def last_prompt(self) -> str | None:
        """The last prompt exactly as the model read it (after the chat template)."""
        return self._answerer.last_prompt

    @property
    def last_generation(self) -> Generation | None:
        """The :class:`Generation` of the last non-streaming call."""
        return self._answerer.last_generation

    @property
    def calls(self) -> int:
        """Number of model calls so far (complete and streamed)."""
        return self._answerer.calls


class AnswerSettings(AnswerFields):
    """The answer settings on their own: frozen, unknown settings refused
    (``pydantic.ValidationError``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def check_passage_source(
    settings: AnswerFields, passages_from: PassageSource | None, who: str
) -> None:
    """Check ``passages_from`` (see :class:`Answerer`) against the answer ``settings`` of
    ``who`` (the component, as the message names it); ``None`` passes.

    Raises:
        ConfigError: ``passages_from`` that is not a :class:`PassageSource`, or with
            ``use_chat_template=False`` (a task prompt is read in the backend's own form, the
            chat template included).
    """
    if passages_from is None:
        return
    if not isinstance(passages_from, PassageSource):
        raise ConfigError(
            f"{who}: passages_from= takes the correction component that passes the documents "
            f"on (it says its last_passages), not {type(passages_from).__name__}"
        )
    if not settings.use_chat_template:
        raise ConfigError(
            f"{who}: passages_from= needs use_chat_template=True (the backend reads a prompt "
            "whose passages it knows in its own form, chat template included)"
        )


class Answerer:
    """A backend answering prompts with checked settings.

    Args:
        settings: an :class:`AnswerFields` instance (a framework component, or
            :class:`AnswerSettings`).
        backend: the backend that answers.
        passages_from: where each prompt's passages come from (the pipeline's correction
            component); ``None``: the prompt is answered as plain text. With a source, each
            call finds the source's :attr:`~PassageSource.last_passages` in the prompt
            (:func:`~ragfix.prompts.find_passages`) and gives the backend the
            :class:`~ragfix.prompts.TaskPrompt` ``(user=prompt, passages=spans, max_new_tokens,
            stop_at_newline)``, the text between two passages as its ``passage_separator``
            when it is the same between every two (what the frameworks' renderers give; else
            ``""``). The model reads the same text as without a source (the chat template
            applied by the backend: :meth:`~ragfix.backends.Backend.format_prompt`), and
            :attr:`last_prompt` is that text.
        who: the component, as messages name it.
        calls_give_passages: every call gives its own documents (``passages=`` of
            :meth:`generate`: a response synthesizer, handed the chunks), so no source is
            read and any backend answers.

    Attributes:
        context_window: the window in use (the setting, clamped to the backend's, or the
            backend's).
        last_prompt: the last prompt exactly as the model read it (after the chat template).
        last_generation: the :class:`Generation` of the last non-streaming call.
        calls: model calls so far.

    Raises:
        ConfigError: without ``passages_from``, a backend that reads passages only where a
            task prompt says they are (:attr:`~ragfix.backends.base.Backend.needs_passage_spans`:
            a framework's prompt is plain text); a bad ``passages_from``
            (:func:`check_passage_source`); ``max_new_tokens`` leaves
            no room for a prompt in the context window (the chat template's own tokens
            counted).
    """

    def __init__(
        self,
        settings: AnswerFields,
        backend: Backend,
        passages_from: PassageSource | None = None,
        who: str = "the LLM component",
        calls_give_passages: bool = False,
    ) -> None:
        self.settings = AnswerSettings(**settings.answer_settings())
        self.who = who
        check_passage_source(self.settings, passages_from, who)
        if calls_give_passages and not self.settings.use_chat_template:
            raise ConfigError(
                f"{who} gives the backend each call's documents: it needs "
                "use_chat_template=True (the backend reads the task prompt in its own form)"
            )
        if passages_from is None and not calls_give_passages:
            try:
                require_plain_prompts(backend, "a framework's LLM component")
            except ConfigError as e:
                if not backend.needs_passage_spans:
                    raise
                raise ConfigError(
                    f"{e}; or give {who} passages_from= (the correction component that passes "
                    "the documents on)"
                ) from None
        self.passages_from = passages_from
        self.backend = backend
        self.last_prompt: str | None = None
        self.last_generation: Generation | None = None
        self.calls = 0
        s, model_window = self.settings, backend.context_window
        self.context_window = s.context_window or model_window
        if self.context_window > model_window:
            warnings.warn(
                f"context_window={self.context_window} is larger than the window of "
                f"{backend.model_name} ({backend.name}): clamped to {model_window}",
                UserWarning,
                stacklevel=4,
            )
            self.context_window = model_window
        empty = backend.format_prompt(TaskPrompt(user=""))
        template = len(backend.tokenize(empty)) if s.use_chat_template else 0
        if s.max_new_tokens + template >= self.context_window:
            raise ConfigError(
                f"num_output={s.max_new_tokens} leaves no room for a prompt in "
                f"context_window={self.context_window}"
                + (f" (the chat template alone takes {template} tokens)" if template else "")
                + "; lower num_output or raise context_window"
            )

    def settings_for_call(self, who: str, **changes) -> AnswerSettings:
        """The settings with one call's ``changes`` (answer settings by name, e.g.
        ``max_new_tokens=3``), validated.

        Raises:
            ConfigError: an unknown setting or an invalid value (one line, naming ``who`` and
                the setting).
        """
        from pydantic import ValidationError

        try:
            return AnswerSettings(**{**self.settings.model_dump(), **changes})
        except ValidationError as e:
            first = e.errors()[0]
            name = ".".join(str(x) for x in first["loc"])
            value = changes.get(name, first.get("input"))
            raise ConfigError(f"{who}: {name}={value!r}: {first['msg']}") from None

    def task_prompt(
        self, prompt: str, settings: AnswerSettings, passages: Sequence[str] | None = None
    ) -> TaskPrompt:
        """``prompt`` as a :class:`~ragfix.prompts.TaskPrompt` with the spans of ``passages`` in
        it (this call's documents, as a synthesizer is handed them), else of the passage
        source's last documents, and the budget and stop rule of ``settings`` (see the class
        docstring).

        Raises:
            ConfigError: the source has passed no documents on yet, or one of them is not in
                ``prompt`` verbatim (after the ones before it): one line naming it (its index
                and first words).
        """
        source = "the call" if passages is not None else type(self.passages_from).__name__
        texts = list(passages) if passages is not None else self.passages_from.last_passages
        if texts is None:
            raise ConfigError(
                f"{self.who}: passages_from={source} has passed no documents on yet: run it "
                "before the LLM in the pipeline"
            )
        spans = find_passages(prompt, texts)
        for i, (text, span) in enumerate(zip(texts, spans, strict=True)):
            if span is None:
                words = " ".join(text.split()[:8])
                raise ConfigError(
                    f"{self.who}: document {i} of {source}'s last {len(texts)} ({words!r}...) "
                    "is not in the prompt verbatim after the ones before it: render the "
                    "documents as the component passes them on, in its order"
                )
        gaps = {prompt[a[1] : b[0]] for a, b in zip(spans, spans[1:], strict=False)}
        return TaskPrompt(
            user=prompt,
            max_new_tokens=settings.max_new_tokens,
            stop_at_newline=settings.stop_at_newline,
            passages=tuple(spans),
            passage_separator=gaps.pop() if len(gaps) == 1 else "",
        )

    def request(
        self,
        prompt: str,
        settings: AnswerSettings | None = None,
        passages: Sequence[str] | None = None,
    ) -> Prompt:
        """What the backend is given for ``prompt`` under ``settings`` (default:
        :attr:`settings`), checked against the window, counted as a call, the text the model
        reads kept as :attr:`last_prompt`: that text itself (``prompt`` in the chat template,
        or as it is with ``use_chat_template=False``), or with a passage source the
        :class:`~ragfix.prompts.TaskPrompt` of :meth:`task_prompt`.

        Raises:
            ConfigError: the prompt as the model reads it plus ``max_new_tokens`` exceeds the
                backend's window (:meth:`~ragfix.backends.Backend.fit`; with a passage source,
                every order a backend answers over counted): refused, never truncated (unless
                the backend cuts long prompts by design,
                :attr:`~ragfix.backends.Backend.cuts_long_prompts`). A backend that cannot
                count tokens here is not checked. See also :meth:`task_prompt`.
        """
        s, b = settings or self.settings, self.backend
        if passages is not None or self.passages_from is not None:
            req: Prompt = self.task_prompt(prompt, s, passages)
            text = b.format_prompt(req)
        else:
            text = b.format_prompt(TaskPrompt(user=prompt)) if s.use_chat_template else prompt
            req = text
        fit = b.fit(req, max_new_tokens=s.max_new_tokens)
        if not fit.runs:
            raise ConfigError(
                f"the prompt has {fit.prompt_tokens} tokens (chat template included); with "
                f"num_output={fit.budget} it exceeds the {fit.window}-token window of "
                f"{b.model_name}: retrieve fewer or shorter documents, or lower num_output"
            )
        self.last_prompt = text
        self.calls += 1
        return req

    def model_prompt(self, prompt: str, settings: AnswerSettings | None = None) -> str:
        """The text the model reads for ``prompt`` (:meth:`request`: counted as a call, kept as
        :attr:`last_prompt`).

        Raises:
            ConfigError: see :meth:`request`.
        """
        self.request(prompt, settings)
        return self.last_prompt

    def generate(
        self,
        prompt: str,
        settings: AnswerSettings | None = None,
        passages: Sequence[str] | None = None,
    ) -> Generation:
        """The greedy answer to ``prompt`` under ``settings`` (default: :attr:`settings`; one
        call's from :meth:`settings_for_call`), its documents ``passages`` when given (see
        :meth:`request`), kept as :attr:`last_generation`.

        Raises:
            ConfigError: see :meth:`request`.
        """
        s = settings or self.settings
        [gen] = self.backend.generate(
            [self.request(prompt, s, passages)],
            batch_size=1,  # one prompt; with prefix_reuse the cache is kept between calls
            max_new_tokens=s.max_new_tokens,
            stop_at_newline=s.stop_at_newline,
            prefix_reuse=s.prefix_reuse,
        )
        self.last_generation = gen
        return gen

    def stream(self, prompt: str, settings: AnswerSettings | None = None) -> Iterator[str]:
        """Yield the answer's new text as the model produces it, through
        :meth:`Backend.stream`, under ``settings`` (as :meth:`generate`). With
        ``stop_at_newline`` nothing after the first newline of the answer (leading white space
        aside) is yielded, and the white space the whole answer is stripped of is not
        (:func:`strip_stream`): the pieces join to :meth:`generate`'s text. The backend's
        stream is closed (its generation stopped, not drained)
        when the newline rule is hit or when the consumer stops iterating. The prompt is checked
        (:meth:`request`) before the first piece is asked for. A backend whose answer exists
        only once it is complete (order marginalization) yields it as one piece.

        Raises:
            ConfigError: see :meth:`request`.
        """
        s = settings or self.settings
        req = self.request(prompt, s)

        def pieces_of() -> Iterator[str]:
            pieces = self.backend.stream(
                req, max_new_tokens=s.max_new_tokens, stop_at_newline=s.stop_at_newline
            )
            if s.stop_at_newline:
                pieces = cut_at_newline(pieces)
            try:
                yield from strip_stream(pieces)
            finally:
                pieces.close()

        return pieces_of()


def strip_stream(pieces: Iterable[str]) -> Iterator[str]:
    """``pieces`` without the white space that a whole answer is stripped of
    (:func:`~ragfix.backends.base.final_answer`): leading white space is dropped, and white
    space is held back until text follows it, so a trailing run is never yielded. Joined, the
    pieces are the stripped answer; no piece is empty."""
    held, started = "", False
    for piece in pieces:
        text = held + (piece if started else piece.lstrip())
        body = text.rstrip()
        held = text[len(body) :]
        if body:
            started = True
            yield body


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any of ``stops`` (empty ones
    ignored); all of it when none occurs."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


class StopStream:
    """Cuts a streamed answer at the stop strings exactly as :func:`cut_at_stop` cuts the whole
    answer: text that may still begin a stop string is held back until the next pieces settle
    it, so no part of a stop string is ever emitted (``stop=[" capital of"]`` over the pieces
    ``"The", " capital", " of"`` emits ``"The"``).

    Args:
        stops: the stop strings (empty ones ignored).

    Attributes:
        stopped: a stop string was found (nothing more will be emitted).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _open_from(self) -> int:
        """The first position at or after :attr:`sent` from which the text read so far is a
        proper beginning of a stop string (its length when there is none)."""
        n = len(self.text)
        for j in range(self.sent, n):
            tail = self.text[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return j
        return n

    def feed(self, piece: str) -> str:
        """Read the next piece; return the text that may be emitted now ("" once stopped)."""
        if self.stopped:
            return ""
        self.text += piece
        whole = cut_at_stop(self.text, self.stops)
        open_from = self._open_from()
        if len(whole) < len(self.text) and len(whole) <= open_from:
            self.stopped = True
            return self._emit(len(whole))
        return self._emit(min(open_from, len(whole)))

    def close(self) -> str:
        """The end of the answer: return the text held back that is not a stop string."""
        if self.stopped:
            return ""
        self.stopped = True
        return self._emit(len(cut_at_stop(self.text, self.stops)))

    def _emit(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out


__all__ = [
    "AnswerFields",
    "AnswerSettings",
    "Answerer",
    "AnswererView",
    "PassageSource",
    "StopStream",
    "check_passage_source",
    "cut_at_stop",
    "strip_stream",
]
