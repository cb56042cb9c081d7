"""``RagFixLLM``: a LlamaIndex ``CustomLLM`` over any ragfix backend.

Any backend (vanilla, channel-scaled, gali, pos2distill ...) becomes the ``llm`` of a LlamaIndex
query engine::

    from ragfix import RagFixLLM
    from ragfix.backends import load_backend

    llm = RagFixLLM(load_backend("gali", model="smollm2"))
    engine = index.as_query_engine(llm=llm, node_postprocessors=[...])

The prompt LlamaIndex builds is wrapped in the model's chat template (unless
``use_chat_template=False``) and answered greedily by the backend.
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
from pydantic import Field, PrivateAttr

from ragfix.backends.base import Backend, PrefixReuser
from ragfix.types import Generation


class RagFixLLM(CustomLLM):
    """A ragfix :class:`~ragfix.backends.Backend` as a LlamaIndex LLM (completion model).

    Args:
        backend: the backend that answers.
        max_new_tokens: generation budget (LlamaIndex's ``num_output``).
        stop_at_newline: cut the answer at its first newline (short-answer QA).
        use_chat_template: wrap the prompt in the model's chat template.
        prefix_reuse: keep the KV cache between calls and reuse the common token prefix of
            consecutive prompts (batch size 1; only for backends that allow it). Same greedy
            answers up to floating-point noise, fewer prefill tokens when prompts share a head.

    ``metadata`` reports the backend's real context window, the output budget and the model name.
    The last prompt (as sent to the model, chat-wrapped) and its :class:`Generation` are kept in
    :attr:`last_prompt` and :attr:`last_generation`; :attr:`calls` counts model calls.
    """

    max_new_tokens: int = Field(default=256, gt=0, description="tokens to generate at most")
    stop_at_newline: bool = Field(default=False, description="cut the answer at a newline")
    use_chat_template: bool = Field(default=True, description="wrap prompts in the chat template")
    prefix_reuse: bool = Field(default=False, description="reuse the KV cache of shared prefixes")

    _backend: Backend = PrivateAttr()
    _reuser: PrefixReuser | None = PrivateAttr(default=None)
    _last_prompt: str | None = PrivateAttr(default=None)
    _last_generation: Generation | None = PrivateAttr(default=None)
    _calls: int = PrivateAttr(default=0)

    def __init__(self, backend: Backend, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._backend = backend
        if self.prefix_reuse and backend.supports_prefix_reuse:
            self._reuser = PrefixReuser(backend)

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
            context_window=self._backend.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=False,
            model_name=f"{self._backend.model_name} ({self._backend.name})",
        )

    def _model_prompt(self, prompt: str) -> str:
        text = self._backend.chat_prompt(prompt) if self.use_chat_template else prompt
        self._last_prompt = text
        self._calls += 1
        return text

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Answer ``prompt`` greedily. ``raw`` holds the :class:`Generation` as a dict."""
        ids = self._backend.encode(self._model_prompt(prompt))
        if self._reuser is not None:
            gen = self._reuser.generate(ids, self.max_new_tokens, self.stop_at_newline)
        else:
            gen = self._backend.generate_ids([ids], self.max_new_tokens, self.stop_at_newline)[0]
        self._last_generation = gen
        return CompletionResponse(text=gen.text, raw=gen.model_dump())

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Yield the answer as the model produces it (``delta`` = the new text, ``text`` = all so
        far), through :meth:`Backend.stream`. With ``stop_at_newline`` nothing after the first
        newline of the answer is yielded."""
        text = self._model_prompt(prompt)

        def gen() -> CompletionResponseGen:
            so_far = ""
            stopped = False
            for piece in self._backend.stream(text, self.max_new_tokens):
                if stopped:
                    continue  # drain the streamer so the generation thread finishes
                if self.stop_at_newline:
                    both = so_far + piece
                    cut = both.find("\n", len(both) - len(both.lstrip()))
                    if cut >= 0:
                        piece, stopped = both[len(so_far) : cut], True
                if piece:
                    so_far += piece
                    yield CompletionResponse(text=so_far, delta=piece)

        return gen()
