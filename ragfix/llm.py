"""``RagFixLLM``: a LlamaIndex ``CustomLLM`` over any ragfix backend.

Any backend (vanilla, channel-scaled, gali, pos2distill ...) becomes the ``llm`` of a LlamaIndex
query engine::

    from ragfix import RagFixLLM
    from ragfix.backends import load_backend

    llm = RagFixLLM(load_backend("gali", model="smollm2"))
    engine = index.as_query_engine(llm=llm, node_postprocessors=[...])

The prompt LlamaIndex builds is wrapped in the model's chat template (unless
``use_chat_template=False``) and answered greedily by the backend.

The settings are checked against the real model when the object is built: ``context_window``
defaults to the backend's window (the model config's ``max_position_embeddings``, a GGUF's
``context_length``, or a method's extended window) and a larger value is clamped to it with a
warning; ``num_output`` (``max_new_tokens``) must leave room for a prompt. Unknown settings are
refused (pydantic ``extra="forbid"``).
"""

from __future__ import annotations

import warnings
from typing import Any

from llama_index.core.base.llms.types import (
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_completion_callback
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr

from ragfix.backends.base import Backend, cut_at_newline
from ragfix.errors import ConfigError
from ragfix.prompts import TaskPrompt
from ragfix.types import Generation


class RagFixLLM(CustomLLM):
    """A ragfix :class:`~ragfix.backends.Backend` as a LlamaIndex LLM (completion model).

    Args:
        backend: the backend that answers.
        max_new_tokens: generation budget in tokens (also accepted as LlamaIndex's
            ``num_output``).
        context_window: tokens (prompt plus answer) LlamaIndex may fill, reported in
            :attr:`metadata`; default: the backend's
            :attr:`~ragfix.backends.Backend.context_window`.
            A larger value is clamped to the backend's window with a ``UserWarning``.
        stop_at_newline: cut the answer at its first newline (short-answer QA).
        use_chat_template: wrap the prompt in the model's chat template.
        prefix_reuse: reuse the KV cache of the common token prefix with the previous prompt
            (the backend keeps it between calls; only for backends that allow it, see
            :attr:`Backend.supports_prefix_reuse`). Same greedy answers up to floating-point
            noise, fewer prefill tokens when prompts share a head.

    ``metadata`` reports the context window (after clamping), the output budget and the model
    name. The last prompt (as sent to the model, chat-wrapped) and its :class:`Generation` are kept
    in :attr:`last_prompt` and :attr:`last_generation`; :attr:`calls` counts model calls.

    Raises:
        ConfigError: (at construction) ``max_new_tokens`` leaves no room for a prompt in the
            context window (the chat template's own tokens counted); (at a call) the prompt as the
            model reads it plus ``max_new_tokens`` exceeds the backend's window: it is refused,
            never truncated (unless the backend cuts long prompts by design,
            :attr:`~ragfix.backends.Backend.cuts_long_prompts`).
        pydantic.ValidationError: an unknown setting or a value out of range.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(
        default=256,
        gt=0,
        validation_alias=AliasChoices("max_new_tokens", "num_output"),
        description="tokens to generate at most (LlamaIndex's num_output)",
    )
    context_window: int | None = Field(
        default=None, gt=0, description="prompt + answer tokens; default: the backend's window"
    )
    stop_at_newline: bool = Field(default=False, description="cut the answer at a newline")
    use_chat_template: bool = Field(default=True, description="wrap prompts in the chat template")
    prefix_reuse: bool = Field(default=False, description="reuse the KV cache of shared prefixes")

    _backend: Backend = PrivateAttr()
    _last_prompt: str | None = PrivateAttr(default=None)
    _last_generation: Generation | None = PrivateAttr(default=None)
    _calls: int = PrivateAttr(default=0)

    def __init__(self, backend: Backend, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._backend = backend
        model_window = backend.context_window
        if self.context_window is None:
            self.context_window = model_window
        elif self.context_window > model_window:
            warnings.warn(
                f"context_window={self.context_window} is larger than the window of "
                f"{backend.model_name} ({backend.name}): clamped to {model_window}",
                UserWarning,
                stacklevel=2,
            )
            self.context_window = model_window
        template = len(backend.encode(TaskPrompt(user=""))) if self.use_chat_template else 0
        if self.max_new_tokens + template >= self.context_window:
            raise ConfigError(
                f"num_output={self.max_new_tokens} leaves no room for a prompt in "
                f"context_window={self.context_window}"
                + (f" (the chat template alone takes {template} tokens)" if template else "")
                + "; lower num_output or raise context_window"
            )

    @classmethod
    def class_name(cls) -> str:
        return "RagFixLLM"

    @property
    def backend(self) -> Backend:
        """The backend that answers."""
        return self._backend

    @property
    def last_prompt(self) -> str | None:
        """The last prompt exactly as the model read it (after the chat template)."""
        return self._last_prompt

    @property
    def last_generation(self) -> Generation | None:
        """The :class:`Generation` of the last non-streaming call."""
        return self._last_generation

    @property
    def calls(self) -> int:
        """Number of model calls so far (``complete`` and ``stream_complete``)."""
        return self._calls

    @property
    def metadata(self) -> LLMMetadata:
        """Context window (prompt + answer tokens), output budget and model name of the backend."""
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=False,
            model_name=f"{self._backend.model_name} ({self._backend.name})",
        )

    def _model_prompt(self, prompt: str) -> str:
        """The text the model reads; refuses one that does not fit the backend's window."""
        if self.use_chat_template:
            text = self._backend.format_prompt(TaskPrompt(user=prompt))
        else:
            text = prompt
        size, window = self._backend.count_tokens(text), self._backend.context_window
        if size + self.max_new_tokens > window and not self._backend.cuts_long_prompts:
            raise ConfigError(
                f"the prompt has {size} tokens (chat template included); with "
                f"num_output={self.max_new_tokens} it exceeds the {window}-token window of "
                f"{self._backend.model_name}: retrieve fewer or shorter nodes, or lower num_output"
            )
        self._last_prompt = text
        self._calls += 1
        return text

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer ``prompt`` greedily. ``raw`` holds the :class:`Generation` as a dict."""
        [gen] = self._backend.generate(
            [self._model_prompt(prompt)],
            batch_size=1,  # one prompt; with prefix_reuse the cache is kept between calls
            max_new_tokens=self.max_new_tokens,
            stop_at_newline=self.stop_at_newline,
            prefix_reuse=self.prefix_reuse,
        )
        self._last_generation = gen
        return CompletionResponse(text=gen.text, raw=gen.model_dump())

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Yield the answer as the model produces it (``delta`` = the new text, ``text`` = all so
        far), through :meth:`Backend.stream`. With ``stop_at_newline`` nothing after the first
        newline of the answer (leading white space aside) is yielded. The backend's stream is
        closed (its generation stopped, not drained) when the newline rule is hit or when the
        consumer stops iterating."""
        text = self._model_prompt(prompt)

        def gen() -> CompletionResponseGen:
            pieces = self._backend.stream(
                text, max_new_tokens=self.max_new_tokens, stop_at_newline=self.stop_at_newline
            )
            if self.stop_at_newline:
                pieces = cut_at_newline(pieces)
            so_far = ""
            try:
                for piece in pieces:
                    if piece:
                        so_far += piece
                        yield CompletionResponse(text=so_far, delta=piece)
            finally:
                pieces.close()

        return gen()
