"""``RagFixLLM``: a LlamaIndex ``CustomLLM`` over any ragfix backend.

Any backend (vanilla, channel-scaled, gali, pos2distill ...) becomes the ``llm`` of a LlamaIndex
query engine::

    from ragfix import RagFixLLM
    from ragfix.backends import load_backend

    llm = RagFixLLM(load_backend("gali", model="smollm2"))
    engine = index.as_query_engine(llm=llm, node_postprocessors=[...])

The prompt LlamaIndex builds is wrapped in the model's chat template (unless
``use_chat_template=False``) and answered greedily by the backend.

A backend that reads a prompt's passages where the prompt says they are (order
marginalization, ``pine``, ``set-based``) answers once the LLM is told where they come from,
the postprocessor that passed the nodes on::

    from ragfix.backends.orders import OrderOptions, marginalize_orders

    post = RagFixPostprocessor(strategy="none", backend=backend)
    llm = RagFixLLM(marginalize_orders(backend, OrderOptions(orders=3)), passages_from=post)
    engine = index.as_query_engine(llm=llm, node_postprocessors=[post])

The settings are checked against the real model when the object is built: ``context_window``
defaults to the backend's window (the model config's ``max_position_embeddings``, a GGUF's
``context_length``, or a method's extended window) and a larger value is clamped to it with a
warning; ``num_output`` (``max_new_tokens``) must leave room for a prompt. Unknown settings are
refused (pydantic ``extra="forbid"``). The settings and the answering are those of
:mod:`ragfix.answering`, shared with the LangChain and Haystack components.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.llms.types import (
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_completion_callback
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr

from ragfix.answering import Answerer, AnswererView, AnswerFields, PassageSource
from ragfix.backends.base import Backend


class RagFixLLM(AnswerFields, AnswererView, CustomLLM):
    """A ragfix :class:`~ragfix.backends.Backend` as a LlamaIndex LLM (completion model).

    Args:
        backend: the backend that answers.
        passages_from: the :class:`~ragfix.postprocessor.RagFixPostprocessor` that passes the
            nodes on to this LLM's prompts: each prompt is given to the backend with the spans
            of the nodes it last passed on (:class:`ragfix.answering.Answerer`), so a backend
            that needs them (order marginalization, ``pine``, ``set-based``) answers;
            ``None``: plain text, and such a backend is refused.
        max_new_tokens, context_window, stop_at_newline, use_chat_template, prefix_reuse: the
            answer settings (:class:`ragfix.answering.AnswerFields`); ``max_new_tokens`` is also
            accepted as LlamaIndex's ``num_output``.

    ``metadata`` reports the context window (after clamping), the output budget and the model
    name. The last prompt (as sent to the model, chat-wrapped) and its :class:`Generation` are kept
    in :attr:`last_prompt` and :attr:`last_generation`; :attr:`calls` counts model calls.

    Raises:
        ConfigError: (at construction) ``max_new_tokens`` leaves no room for a prompt in the
            context window (the chat template's own tokens counted), a backend that needs
            passage spans without ``passages_from``, ``passages_from`` with
            ``use_chat_template=False``; (at a call) the prompt as the model reads it plus
            ``max_new_tokens`` exceeds the backend's window: it is refused, never truncated
            (unless the backend cuts long prompts by design,
            :attr:`~ragfix.backends.Backend.cuts_long_prompts`); with ``passages_from``, a node
            it passed on that is not in the prompt verbatim.
        pydantic.ValidationError: an unknown setting or a value out of range.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(
        default=256,
        gt=0,
        validation_alias=AliasChoices("max_new_tokens", "num_output"),
        description="tokens to generate at most (LlamaIndex's num_output)",
    )

    _answerer: Answerer = PrivateAttr()

    def __init__(
        self, backend: Backend, passages_from: PassageSource | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._answerer = Answerer(self, backend, passages_from, who="RagFixLLM")
        self.context_window = self._answerer.context_window

    @classmethod
    def class_name(cls) -> str:
        return "RagFixLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """Context window (prompt + answer tokens), output budget and model name of the backend."""
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=False,
            model_name=f"{self.backend.model_name} ({self.backend.name})",
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer ``prompt`` greedily. ``raw`` holds the :class:`Generation` as a dict."""
        gen = self._answerer.generate(prompt)
        return CompletionResponse(text=gen.text, raw=gen.model_dump())

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Yield the answer as the model produces it (``delta`` = the new text, ``text`` = all so
        far), through :meth:`ragfix.answering.Answerer.stream` (newline rule, the backend's
        stream closed when the consumer stops)."""
        pieces = self._answerer.stream(prompt)

        def gen() -> CompletionResponseGen:
            so_far = ""
            try:
                for piece in pieces:
                    so_far += piece
                    yield CompletionResponse(text=so_far, delta=piece)
            finally:
                pieces.close()

        return gen()
