"""ragfix in LangChain: ``RagFixCompressor`` and ``RagFixChatModel`` (``pip install
"ragfix[langchain]"``).

The two-line change to an existing retrieval chain (it replaces ``LongContextReorder``, or wraps
the retriever)::

    from ragfix.integrations.langchain import RagFixCompressor
    retriever = ContextualCompressionRetriever(
        base_compressor=RagFixCompressor(strategy="lost-in-the-middle", backend=backend),
        base_retriever=retriever)

A whole chain over the embedded models (``docs/langchain.md``)::

    from langchain_community.vectorstores import FAISS
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from ragfix.backends import load_backend
    from ragfix.integrations.langchain import (RagFixChatModel, RagFixCompressor, embeddings,
                                               format_documents, qa_prompt)

    backend = load_backend("vanilla")
    store = FAISS.from_documents(docs, embeddings())
    retriever = ContextualCompressionRetriever(
        base_compressor=RagFixCompressor(strategy="lost-in-the-middle", backend=backend),
        base_retriever=store.as_retriever(search_kwargs={"k": 10}))
    chain = ({"context": retriever | RunnableLambda(format_documents),
              "question": RunnablePassthrough()}
             | qa_prompt() | RagFixChatModel(backend, stop_at_newline=True) | StrOutputParser())

:class:`RagFixCompressor` runs the correction of :mod:`ragfix.correction` (drop blank and
near-duplicate documents, fit the backend's token budget, reorder), the same code and settings as
the LlamaIndex :class:`~ragfix.postprocessor.RagFixPostprocessor`. :class:`RagFixChatModel`
answers with a backend through :mod:`ragfix.answering`, as :class:`~ragfix.llm.RagFixLLM` does.
:func:`qa_prompt` and :func:`format_documents` give the prompt text the LlamaIndex pipeline gives
(the ``qa`` task's template, chunks rendered by :func:`ragfix.tasks.render_chunk`).
"""

from __future__ import annotations

from ragfix.integrations import require_extra

require_extra("langchain")

import os  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from langchain_core.callbacks import CallbackManagerForLLMRun, Callbacks  # noqa: E402
from langchain_core.documents import (  # noqa: E402
    BaseDocumentCompressor,
    BaseDocumentTransformer,
    Document,
)
from langchain_core.language_models.chat_models import BaseChatModel  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    UsageMetadata,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from pydantic import ConfigDict, PrivateAttr  # noqa: E402

from ragfix.answering import (  # noqa: E402
    Answerer,
    AnswererView,
    AnswerFields,
    AnswerSettings,
    PassageSource,
    StopStream,
    cut_at_stop,
)
from ragfix.backends.base import Backend  # noqa: E402
from ragfix.correction import Candidate, Correction, CorrectionFields  # noqa: E402
from ragfix.errors import ConfigError  # noqa: E402
from ragfix.integrations.engine import PipelineEngines, node_parts  # noqa: E402
from ragfix.prompts import join_text_parts  # noqa: E402
from ragfix.tasks import get_task, join_chunks, render_chunk  # noqa: E402


def _title(doc: Document) -> str:
    return str(doc.metadata.get("title", ""))


def format_documents(documents: Sequence[Document]) -> str:
    """The ``{context}`` of :func:`qa_prompt`: each document as ``Document (Title: t) text``
    (title from ``metadata["title"]``; the bare text without one), joined by a blank line, as
    the LlamaIndex pipeline renders its nodes (:func:`ragfix.tasks.join_chunks`)."""
    return join_chunks([render_chunk(_title(d), d.page_content) for d in documents])


def qa_prompt(task: str = "qa") -> ChatPromptTemplate:
    """The task record's user turn as a LangChain chat prompt with ``{context}`` and
    ``{question}`` (the prompt the bias profiles were measured with; the same text as
    :func:`ragfix.postprocessor.text_qa_template` for LlamaIndex).

    Raises:
        ConfigError: unknown task.
    """
    user = get_task(task).placeholder_template("{context}", "{question}")
    return ChatPromptTemplate.from_messages([("human", user)])


def embeddings():
    """The embedded all-MiniLM-L6-v2 as LangChain embeddings (``HuggingFaceEmbeddings`` of
    ``langchain_community`` over the bundled model folder; offline). For
    ``FAISS.from_documents(docs, embeddings())``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from langchain_community.embeddings import HuggingFaceEmbeddings

    from ragfix.models.resolve import default_embedder_path

    with warnings.catch_warnings():  # langchain-huggingface's copy pins an older hub client
        warnings.simplefilter("ignore")
        return HuggingFaceEmbeddings(model_name=str(default_embedder_path()))


class RagFixCompressor(CorrectionFields, BaseDocumentCompressor, BaseDocumentTransformer):
    """Drop blank documents and near-duplicates, fit the token budget, then reorder: a LangChain
    document compressor (``ContextualCompressionRetriever(base_compressor=...)``) and document
    transformer (in place of ``LongContextReorder``).

    Documents arrive in retrieval order (rank 0 first; scores are not needed). Each is judged as
    the LLM reads it through :func:`format_documents`. What was dropped (document ids, or the
    retrieval rank as a string for a document without one) and the order are in
    :attr:`last_report`.

    Args:
        strategy, profile, profile_curve, num_docs, dedup_threshold, token_budget,
            reserve_tokens, over_budget, attention_rounds: the correction settings
            (:class:`ragfix.correction.CorrectionFields`, the same for every framework).
        backend: a :class:`ragfix.backends.Backend` (token counting, model identity,
            attention-sort); kept as a private attribute.

    Raises:
        ConfigError: (at construction) see :class:`ragfix.correction.Correction`.
        pydantic.ValidationError: an unknown setting, an unknown strategy or a value out of range.
        ragfix.reorder.ProfileError: a profile of another model or number of documents.
        ragfix.pruning.BudgetError: (when run, ``over_budget="error"``) the best document alone
            exceeds the token budget.
    """

    model_config = ConfigDict(extra="forbid")

    _correction: Correction = PrivateAttr()

    def __init__(self, backend: Backend | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._correction = Correction(self, backend, noun="document")

    @property
    def last_report(self) -> dict:
        """What the last call did (see :meth:`ragfix.correction.Correction.apply`)."""
        return self._correction.last_report

    @property
    def last_passages(self) -> list[str] | None:
        """The documents the last call passed on, in prompt order, each as
        :func:`format_documents` renders it (``Document (Title: t) page_content``, the bare
        ``page_content`` without a title); ``None`` before the first call and after one that
        raised. What makes it a :class:`ragfix.answering.PassageSource` for
        ``RagFixChatModel(passages_from=...)``."""
        return self._correction.last_passages

    def _apply(self, documents: Sequence[Document], query: str | None) -> list[Document]:
        candidates = [
            Candidate(
                id=d.id or str(i),
                text=render_chunk(_title(d), d.page_content),
                content=d.page_content,
                title=_title(d),
            )
            for i, d in enumerate(documents)
        ]
        return [documents[i] for i in self._correction.apply(candidates, query)]

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        """The corrected documents in prompt order (``query`` is read by attention-sort)."""
        return self._apply(documents, query)

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> list[Document]:
        """The corrected documents in prompt order (``query=`` is read by attention-sort)."""
        return self._apply(documents, kwargs.get("query"))


#: the keywords one call may give (``invoke(..., max_tokens=3)``, ``bind(max_tokens=3)``), by the
#: answer setting each sets; any other keyword is refused
CALL_SETTINGS = {
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "stop_at_newline": "stop_at_newline",
}


class RagFixChatModel(AnswerFields, AnswererView, BaseChatModel):
    """A ragfix :class:`~ragfix.backends.Backend` as a LangChain chat model (greedy).

    It answers one user turn (a single ``HumanMessage``, e.g. from :func:`qa_prompt`), wrapped in
    the model's chat template, like :class:`ragfix.llm.RagFixLLM`; streaming goes through
    :meth:`Backend.stream`. A ``HumanMessage`` whose content is a list of blocks is read as its
    text blocks (strings and ``{"type": "text"}``) joined as ``ragfix serve`` joins text parts
    (:func:`ragfix.prompts.join_text_parts`: nothing between them). ``stop`` strings cut the
    answer after generation; streamed, the text that may begin a stop string is held back
    (:class:`ragfix.answering.StopStream`), so ``stream`` and ``invoke`` give the same text.
    One call may set ``max_tokens`` (or ``max_new_tokens``) and ``stop_at_newline``
    (:data:`CALL_SETTINGS`), given to ``invoke`` or ``bind``. An answer's token counts are its
    message's ``usage_metadata`` (``invoke``; a streamed answer carries none).

    Args:
        backend: the backend that answers.
        passages_from: the :class:`RagFixCompressor` that passes the documents on to this
            model's prompts: each prompt is given to the backend with the spans of the
            documents it last passed on (:class:`ragfix.answering.Answerer`), so a backend that
            needs them (order marginalization, ``pine``, ``set-based``) answers; ``None``:
            plain text, and such a backend is refused.
        max_new_tokens, context_window, stop_at_newline, use_chat_template, prefix_reuse: the
            answer settings (:class:`ragfix.answering.AnswerFields`).

    The last prompt (as the model read it) and its :class:`Generation` are in
    :attr:`last_prompt` and :attr:`last_generation`; :attr:`calls` counts model calls.

    Raises:
        ConfigError: (at construction) ``max_new_tokens`` leaves no room for a prompt, a backend
            that needs passage spans without ``passages_from``, ``passages_from`` with
            ``use_chat_template=False``; (at a call) messages other than one user turn, a
            content block that is not text, a keyword other than :data:`CALL_SETTINGS` or an
            invalid value of one, a prompt that does not fit the window (never truncated), or
            with ``passages_from`` a document it passed on that is not in the prompt verbatim.
        pydantic.ValidationError: an unknown setting or a value out of range.
    """

    model_config = ConfigDict(extra="forbid")

    _answerer: Answerer = PrivateAttr()

    def __init__(
        self, backend: Backend, passages_from: PassageSource | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._answerer = Answerer(self, backend, passages_from, who="RagFixChatModel")
        self.context_window = self._answerer.context_window

    @property
    def _llm_type(self) -> str:
        return "ragfix"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        b = self._answerer.backend
        return {"model": b.model_name, "backend": b.name, **self.answer_settings()}

    @staticmethod
    def _user_turn(messages: list[BaseMessage]) -> str:
        """The text of the one user turn (its text blocks joined).

        Raises:
            ConfigError: not one ``HumanMessage``, or a content block that is not text.
        """
        if len(messages) != 1 or not isinstance(messages[0], HumanMessage):
            kinds = ", ".join(type(m).__name__ for m in messages) or "none"
            raise ConfigError(
                f"RagFixChatModel answers one user turn (one HumanMessage), got: {kinds}"
            )
        content = messages[0].content
        if isinstance(content, str):
            return content
        texts = []
        for i, block in enumerate(content):
            if isinstance(block, str):
                texts.append(block)
            elif isinstance(block, dict) and block.get("type") == "text":
                texts.append(str(block.get("text", "")))
            else:
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise ConfigError(
                    f"RagFixChatModel reads text only: content block {i} of the HumanMessage "
                    f"is {kind!r}"
                )
        return join_text_parts(texts)

    def _call_settings(self, kwargs: dict[str, Any]) -> AnswerSettings | None:
        """The settings of one call with keywords ``kwargs`` (None: the model's own).

        Raises:
            ConfigError: a keyword other than :data:`CALL_SETTINGS`, or an invalid value.
        """
        unknown = sorted(set(kwargs) - set(CALL_SETTINGS))
        if unknown:
            raise ConfigError(
                f"RagFixChatModel does not take {', '.join(unknown)} per call (it takes "
                f"{', '.join(CALL_SETTINGS)} and stop)"
            )
        if not kwargs:
            return None
        changes = {CALL_SETTINGS[k]: v for k, v in kwargs.items()}
        return self._answerer.settings_for_call("RagFixChatModel", **changes)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        settings = self._call_settings(kwargs)
        gen = self._answerer.generate(self._user_turn(messages), settings)
        meta = {"prompt_tokens": gen.prompt_tokens, "new_tokens": gen.new_tokens}
        usage = UsageMetadata(
            input_tokens=gen.prompt_tokens,
            output_tokens=gen.new_tokens,
            total_tokens=gen.prompt_tokens + gen.new_tokens,
        )
        message = AIMessage(
            content=cut_at_stop(gen.text, stop or []),
            response_metadata=meta,
            usage_metadata=usage,
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        settings = self._call_settings(kwargs)
        pieces = self._answerer.stream(self._user_turn(messages), settings)
        cutter = StopStream(stop or [])

        def chunk(text: str) -> ChatGenerationChunk:
            out = ChatGenerationChunk(message=AIMessageChunk(content=text))
            if run_manager is not None:
                run_manager.on_llm_new_token(text, chunk=out)
            return out

        try:
            for piece in pieces:
                kept = cutter.feed(piece)
                if kept:
                    yield chunk(kept)
                if cutter.stopped:  # a stop string was hit: the generation is stopped
                    return
            rest = cutter.close()
            if rest:
                yield chunk(rest)
        finally:
            pieces.close()


class LangChainEngines(PipelineEngines):
    """LangChain: a chain per strategy (a ``ContextualCompressionRetriever`` with
    :class:`~ragfix.integrations.langchain.RagFixCompressor` over a retriever returning the
    cell's candidates, the ``qa`` prompt, :class:`~ragfix.integrations.langchain.RagFixChatModel`,
    a chat model per strategy over the one backend)."""

    framework = "langchain"

    def _build(self, s: str, settings: dict) -> None:
        from operator import itemgetter

        from langchain_classic.retrievers import ContextualCompressionRetriever
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.retrievers import BaseRetriever
        from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough

        if not self.llms:

            class FixedRetriever(BaseRetriever):
                """Returns the document list it was last given (the cell's candidates)."""

                docs: list = []

                def _get_relevant_documents(self, query, *, run_manager=None):
                    return list(self.docs)

            self.fixed = FixedRetriever()
            self.chains: dict = {}
        self.posts[s] = RagFixCompressor(backend=self.backend, **settings)
        self.llms[s] = chat = RagFixChatModel(
            self.backend, passages_from=self.source(s), **self.answer
        )
        retriever = ContextualCompressionRetriever(
            base_compressor=self.posts[s], base_retriever=self.fixed
        )
        answer = (
            {
                "context": itemgetter("docs") | RunnableLambda(format_documents),
                "question": itemgetter("question"),
            }
            | qa_prompt(self.task.name)
            | chat
            | StrOutputParser()
        )
        self.chains[s] = RunnableParallel(docs=retriever, question=RunnablePassthrough()).assign(
            answer=answer
        )

    @staticmethod
    def _docs(cands: list) -> list:
        return [
            Document(page_content=text, metadata={"title": title, "score": score}, id=i)
            for i, title, text, score in map(node_parts, cands)
        ]

    def _order(self, s: str, cands: list) -> list[str]:
        return [d.id for d in self.posts[s].compress_documents(self._docs(cands), "")]

    def _query(self, s: str, question: str, cands: list) -> tuple[list[str], str]:
        self.fixed.docs = self._docs(cands)
        out = self.chains[s].invoke(question)
        return [d.id for d in out["docs"]], out["answer"]


__all__ = [
    "CALL_SETTINGS",
    "embeddings",
    "format_documents",
    "LangChainEngines",
    "qa_prompt",
    "RagFixChatModel",
    "RagFixCompressor",
]
