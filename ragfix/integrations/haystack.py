"""ragfix in Haystack: ``RagFixRanker`` and ``RagFixChatGenerator`` (``pip install
"ragfix[haystack]"``).

The two-line change to an existing pipeline (in place of ``LostInTheMiddleRanker``)::

    from ragfix.integrations.haystack import RagFixRanker
    pipe.add_component("ranker", RagFixRanker(strategy="lost-in-the-middle", backend=backend))

A whole pipeline over the embedded models (``docs/haystack.md``)::

    from ragfix.integrations.haystack import (RagFixChatGenerator, RagFixRanker, qa_prompt_builder,
                                              text_embedder)

    pipe = Pipeline()
    pipe.add_component("embedder", text_embedder())
    pipe.add_component("retriever", InMemoryEmbeddingRetriever(store, top_k=10))
    pipe.add_component("ranker", RagFixRanker(strategy="lost-in-the-middle", backend=backend))
    pipe.add_component("prompt", qa_prompt_builder())
    pipe.add_component("llm", RagFixChatGenerator(backend, stop_at_newline=True))
    pipe.connect("embedder.embedding", "retriever.query_embedding")
    pipe.connect("retriever.documents", "ranker.documents")
    pipe.connect("ranker.context", "prompt.context")
    pipe.connect("prompt.prompt", "llm.messages")
    pipe.run({"embedder": {"text": q}, "ranker": {"query": q}, "prompt": {"query": q}})

:class:`RagFixRanker` runs the correction of :mod:`ragfix.correction` (drop blank and
near-duplicate documents, fit the backend's token budget, reorder), the same code and settings as
the LlamaIndex :class:`~ragfix.postprocessor.RagFixPostprocessor`; besides the documents it
outputs ``context``, the documents as the LLM reads them (:func:`ragfix.tasks.join_chunks`), which
:func:`qa_prompt_builder` puts into the ``qa`` task's prompt: the same prompt text as the
LlamaIndex and LangChain pipelines. :class:`RagFixChatGenerator` answers with a backend through
:mod:`ragfix.answering`, as :class:`~ragfix.llm.RagFixLLM` does.

Both serialise like Haystack's own components (``to_dict``/``from_dict``, so ``Pipeline.dumps``
and ``Pipeline.loads`` YAML): the backend is saved as a :class:`ragfix.backends.BackendRef`
(name, model, adapter, options) and loaded in ``warm_up`` (once per process for the components
that name the same backend).
"""

from __future__ import annotations

from ragfix.integrations import require_extra

require_extra("haystack")

import os  # noqa: E402
from typing import Any  # noqa: E402

from haystack import Document, component, default_from_dict, default_to_dict  # noqa: E402
from haystack.components.builders import ChatPromptBuilder  # noqa: E402
from haystack.dataclasses import ChatMessage, StreamingCallbackT, StreamingChunk  # noqa: E402

from ragfix.answering import (  # noqa: E402
    Answerer,
    AnswerSettings,
    PassageSource,
    check_passage_source,
)
from ragfix.backends import BackendRef  # noqa: E402
from ragfix.backends.base import Backend  # noqa: E402
from ragfix.correction import Candidate, Correction, CorrectionSettings  # noqa: E402
from ragfix.errors import ConfigError  # noqa: E402
from ragfix.integrations.engine import PipelineEngines, node_parts  # noqa: E402
from ragfix.prompts import join_text_parts  # noqa: E402
from ragfix.tasks import get_task, join_chunks, render_chunk  # noqa: E402
from ragfix.types import Generation  # noqa: E402


def _title(doc: Document) -> str:
    return str(doc.meta.get("title", ""))


def _chunk(doc: Document) -> str:
    return render_chunk(_title(doc), doc.content or "")


def qa_prompt_builder(task: str = "qa") -> ChatPromptBuilder:
    """The task record's user turn as a Haystack ``ChatPromptBuilder`` with the inputs
    ``context`` (connect :class:`RagFixRanker`'s ``context``) and ``query`` (the prompt the bias
    profiles were measured with; the same text as the LlamaIndex and LangChain prompts).

    Raises:
        ConfigError: unknown task.
    """
    user = get_task(task).placeholder_template("{{ context }}", "{{ query }}")
    return ChatPromptBuilder(template=[ChatMessage.from_user(user)])


def _embedder_path() -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ragfix.models.resolve import default_embedder_path

    return str(default_embedder_path())


def document_embedder():
    """The embedded all-MiniLM-L6-v2 as a Haystack ``SentenceTransformersDocumentEmbedder``
    (``sentence-transformers-haystack``; offline), for writing documents to a store."""
    from haystack_integrations.components.embedders.sentence_transformers import (
        SentenceTransformersDocumentEmbedder,
    )

    return SentenceTransformersDocumentEmbedder(model=_embedder_path(), progress_bar=False)


def text_embedder():
    """The embedded all-MiniLM-L6-v2 as a Haystack ``SentenceTransformersTextEmbedder``, for the
    query of an ``InMemoryEmbeddingRetriever``."""
    from haystack_integrations.components.embedders.sentence_transformers import (
        SentenceTransformersTextEmbedder,
    )

    return SentenceTransformersTextEmbedder(model=_embedder_path(), progress_bar=False)


class _BackendHolder:
    """A backend given as a loaded :class:`Backend` or as a :class:`BackendRef` (dict) that is
    loaded in ``warm_up``; serialised as the reference."""

    def __init__(self, backend: Backend | BackendRef | dict | None) -> None:
        self._backend = backend if isinstance(backend, Backend) else None
        if isinstance(backend, Backend):
            self.ref: BackendRef | None = BackendRef.of(backend)
        elif isinstance(backend, dict):
            self.ref = BackendRef(**backend).check()
        else:
            self.ref = backend.check() if backend is not None else None

    def get(self) -> Backend | None:
        if self._backend is None and self.ref is not None:
            self._backend = self.ref.load()
        return self._backend

    def to_dict(self) -> dict | None:
        return None if self.ref is None else self.ref.model_dump(mode="json")


@component
class RagFixRanker:
    """Drop blank documents and near-duplicates, fit the token budget, then reorder: a Haystack
    ranker (in place of ``LostInTheMiddleRanker``, last before the prompt builder).

    Documents arrive in retrieval order (rank 0 first; scores are not needed); a document without
    text content counts as blank. Each is judged as the LLM reads it (``Document (Title: t)
    text``, title from ``meta["title"]``). What was dropped (document ids) and the order are in
    :attr:`last_report`.

    Args:
        backend: a :class:`ragfix.backends.Backend`, or a :class:`ragfix.backends.BackendRef` (or
            its dict) loaded in :meth:`warm_up`; ``None`` for the content-blind strategies
            without a budget.
        **settings: the correction settings ``strategy``, ``profile``, ``profile_curve``,
            ``num_docs``, ``dedup_threshold``, ``token_budget``, ``reserve_tokens``,
            ``over_budget``, ``attention_rounds`` (:class:`ragfix.correction.CorrectionFields`,
            the same for every framework).

    Raises:
        pydantic.ValidationError: an unknown setting, an unknown strategy or a value out of range
            (when built).
        ConfigError: settings that cannot work with the backend (see
            :class:`ragfix.correction.Correction`; when built with a loaded backend, else in
            :meth:`warm_up`).
        ragfix.reorder.ProfileError: a profile of another model or number of documents.
        ragfix.pruning.BudgetError: (when run, ``over_budget="error"``) the best document alone
            exceeds the token budget.
    """

    def __init__(self, backend: Backend | BackendRef | dict | None = None, **settings: Any):
        self.settings = CorrectionSettings(**settings)
        self._holder = _BackendHolder(backend)
        self._correction: Correction | None = None
        if self._holder.ref is None or isinstance(backend, Backend):
            self.warm_up()

    def warm_up(self) -> None:
        """Load the backend (when given as a reference) and check the settings against it."""
        if self._correction is None:
            self._correction = Correction(self.settings, self._holder.get(), noun="document")

    @property
    def last_report(self) -> dict:
        """What the last run did (see :meth:`ragfix.correction.Correction.apply`)."""
        return self._correction.last_report if self._correction is not None else {}

    @property
    def last_passages(self) -> list[str] | None:
        """The documents the last run passed on, in prompt order, each as its ``context``
        renders it (``Document (Title: t) content``, the bare ``content`` without a title);
        ``None`` before the first run and after one that raised. What makes it a
        :class:`ragfix.answering.PassageSource` for ``RagFixChatGenerator(passages_from=...)``."""
        return self._correction.last_passages if self._correction is not None else None

    @component.output_types(documents=list[Document], context=str)
    def run(self, documents: list[Document], query: str | None = None) -> dict[str, Any]:
        """Correct and reorder ``documents``.

        Args:
            documents: the retrieved documents, best first.
            query: the question (read by ``attention-sort``).

        Returns:
            ``documents`` (the kept ones, in prompt order) and ``context`` (them as the LLM
            reads them, for :func:`qa_prompt_builder`).
        """
        self.warm_up()
        candidates = [
            Candidate(id=d.id, text=_chunk(d), content=d.content or "", title=_title(d))
            for d in documents
        ]
        kept = [documents[i] for i in self._correction.apply(candidates, query)]
        return {"documents": kept, "context": join_chunks([_chunk(d) for d in kept])}

    def to_dict(self) -> dict[str, Any]:
        """The component as a dict (``Pipeline.dumps``): the settings and the backend
        reference."""
        return default_to_dict(
            self, backend=self._holder.to_dict(), **self.settings.model_dump(mode="json")
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RagFixRanker:
        """The component from :meth:`to_dict`'s dict (``Pipeline.loads``)."""
        return default_from_dict(cls, data)


def _user_text(messages: list[ChatMessage]) -> str:
    """The text of the one user message: its text parts joined
    (:func:`ragfix.prompts.join_text_parts`).

    Raises:
        ConfigError: not exactly one user message with text, or a part that is not text.
    """
    if len(messages) != 1 or not messages[0].is_from("user") or not messages[0].texts:
        roles = ", ".join(str(m.role.value) for m in messages) or "none"
        raise ConfigError(f"RagFixChatGenerator answers one user message, got: {roles}")
    parts = messages[0].to_dict()["content"]  # one {kind: value} per part
    for i, part in enumerate(parts):
        kind = next(iter(part), "empty")
        if kind != "text":
            raise ConfigError(
                f"RagFixChatGenerator reads text only: part {i} of the user message is {kind!r}"
            )
    return join_text_parts(messages[0].texts)


@component
class RagFixChatGenerator:
    """A ragfix :class:`~ragfix.backends.Backend` as a Haystack chat generator (greedy).

    It answers one user message (e.g. from :func:`qa_prompt_builder`), wrapped in the model's
    chat template, like :class:`ragfix.llm.RagFixLLM`; a ``streaming_callback`` receives the
    answer piece by piece (:meth:`Backend.stream`). A message of several text parts
    (``ChatMessage.from_user(content_parts=[...])``) is read as all of them joined as
    ``ragfix serve`` joins text parts (:func:`ragfix.prompts.join_text_parts`: nothing between
    them); a part that is not text (an image, a file, a tool call) is refused.

    Args:
        backend: a :class:`ragfix.backends.Backend`, or a :class:`ragfix.backends.BackendRef` (or
            its dict) loaded in :meth:`warm_up`.
        passages_from: the :class:`RagFixRanker` whose ``context`` goes into this generator's
            prompt: each prompt is given to the backend with the spans of the documents it last
            passed on (:class:`ragfix.answering.Answerer`), so a backend that needs them (order
            marginalization, ``pine``, ``set-based``) answers; ``None``: plain text, and such a
            backend is refused. A component reference is not serialised: :meth:`to_dict`
            refuses a generator that has one.
        **settings: the answer settings ``max_new_tokens``, ``context_window``,
            ``stop_at_newline``, ``use_chat_template``, ``prefix_reuse``
            (:class:`ragfix.answering.AnswerFields`).

    The last prompt (as the model read it) and its :class:`Generation` are in
    :attr:`last_prompt` and :attr:`last_generation`; :attr:`calls` counts model calls.

    Raises:
        pydantic.ValidationError: an unknown setting or a value out of range (when built).
        ConfigError: ``passages_from`` with ``use_chat_template=False`` (when built);
            ``max_new_tokens`` leaves no room for a prompt, or a backend that needs passage
            spans without ``passages_from`` (when the backend is loaded); (when run) messages
            other than one user message, a part that is not text, a prompt that does not fit
            the window (never truncated), or with ``passages_from`` a document it passed on
            that is not in the prompt verbatim.
    """

    def __init__(
        self,
        backend: Backend | BackendRef | dict,
        passages_from: PassageSource | None = None,
        **settings: Any,
    ):
        self.settings = AnswerSettings(**settings)
        check_passage_source(self.settings, passages_from, "RagFixChatGenerator")
        self.passages_from = passages_from
        self._holder = _BackendHolder(backend)
        if self._holder.ref is None:
            raise ConfigError("RagFixChatGenerator needs backend= (a Backend or a BackendRef)")
        self._answerer: Answerer | None = None
        if isinstance(backend, Backend):
            self.warm_up()

    def warm_up(self) -> None:
        """Load the backend (when given as a reference) and check the settings against it."""
        if self._answerer is None:
            self._answerer = Answerer(
                self.settings, self._holder.get(), self.passages_from, who="RagFixChatGenerator"
            )

    @property
    def last_prompt(self) -> str | None:
        """The last prompt exactly as the model read it (after the chat template)."""
        return self._answerer.last_prompt if self._answerer is not None else None

    @property
    def last_generation(self) -> Generation | None:
        """The :class:`Generation` of the last non-streaming run."""
        return self._answerer.last_generation if self._answerer is not None else None

    @property
    def calls(self) -> int:
        """Number of model calls so far."""
        return self._answerer.calls if self._answerer is not None else 0

    @component.output_types(replies=list[ChatMessage])
    def run(
        self, messages: list[ChatMessage], streaming_callback: StreamingCallbackT | None = None
    ) -> dict[str, list[ChatMessage]]:
        """Answer the user message.

        Args:
            messages: one user message.
            streaming_callback: called with a ``StreamingChunk`` per piece of the answer.

        Returns:
            ``replies``: one assistant message (``meta``: model, prompt and new tokens).

        Raises:
            ConfigError: not exactly one user message, a part of it that is not text, or a
                prompt that does not fit the window.
        """
        self.warm_up()
        user = _user_text(messages)
        meta: dict[str, Any] = {"model": self._answerer.backend.model_name}
        if streaming_callback is None:
            gen = self._answerer.generate(user)
            text = gen.text
            meta.update(prompt_tokens=gen.prompt_tokens, new_tokens=gen.new_tokens)
        else:
            text = ""
            for piece in self._answerer.stream(user):
                text += piece
                streaming_callback(StreamingChunk(content=piece))
        return {"replies": [ChatMessage.from_assistant(text, meta=meta)]}

    def to_dict(self) -> dict[str, Any]:
        """The component as a dict (``Pipeline.dumps``): the settings and the backend
        reference.

        Raises:
            ConfigError: a generator with ``passages_from`` (a component reference has no
                serialised form).
        """
        if self.passages_from is not None:
            raise ConfigError(
                "RagFixChatGenerator with passages_from= cannot be serialised (a reference to "
                "another component): build it in code"
            )
        return default_to_dict(
            self, backend=self._holder.to_dict(), **self.settings.model_dump(mode="json")
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RagFixChatGenerator:
        """The component from :meth:`to_dict`'s dict (``Pipeline.loads``)."""
        return default_from_dict(cls, data)


class HaystackEngines(PipelineEngines):
    """Haystack: a pipeline per strategy (the cell's candidates as the ranker's input,
    :class:`~ragfix.integrations.haystack.RagFixRanker`, the ``qa`` prompt builder,
    :class:`~ragfix.integrations.haystack.RagFixChatGenerator`; a generator per pipeline, as a
    Haystack component belongs to one pipeline, all over the same backend)."""

    framework = "haystack"

    def _build(self, s: str, settings: dict) -> None:
        os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # offline evaluation
        from haystack import Pipeline

        if not self.llms:
            self.pipes: dict = {}
        self.posts[s] = RagFixRanker(backend=self.backend, **settings)
        self.llms[s] = RagFixChatGenerator(
            self.backend, passages_from=self.source(s), **self.answer
        )
        pipe = Pipeline()
        pipe.add_component("ranker", self.posts[s])
        pipe.add_component("prompt", qa_prompt_builder(self.task.name))
        pipe.add_component("llm", self.llms[s])
        pipe.connect("ranker.context", "prompt.context")
        pipe.connect("prompt.prompt", "llm.messages")
        self.pipes[s] = pipe

    @staticmethod
    def _docs(cands: list) -> list:
        return [
            Document(id=i, content=text, meta={"title": title}, score=score)
            for i, title, text, score in map(node_parts, cands)
        ]

    def _order(self, s: str, cands: list) -> list[str]:
        return [d.id for d in self.posts[s].run(self._docs(cands))["documents"]]

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        out = self.pipes[s].run(
            {
                "ranker": {"documents": self._docs(cands), "query": question},
                "prompt": {"query": question},
            }
        )
        [reply] = out["llm"]["replies"]
        return [d.id for d in out["ranker"]["documents"]], reply.text or ""


__all__ = [
    "document_embedder",
    "HaystackEngines",
    "qa_prompt_builder",
    "RagFixChatGenerator",
    "RagFixRanker",
    "text_embedder",
]
