"""``RagFixSynthesizer``: a LlamaIndex response synthesizer over any ragfix backend, with no
shared state.

LlamaIndex hands a synthesizer the chunks of each query (``get_response(query_str,
text_chunks)``, the nodes the postprocessors passed on, in their order). The synthesizer writes
the QA task's prompt from them (:func:`ragfix.tasks.join_chunks`, the task's user turn) and
gives the backend a :class:`~ragfix.prompts.TaskPrompt` that says where each chunk is, so every
backend answers, those that read passages where the prompt says they are included (order
marginalization, ``pine``, ``set-based``)::

    from ragfix import RagFixPostprocessor, RagFixSynthesizer
    from ragfix.backends.orders import OrderOptions, marginalize_orders

    engine = RetrieverQueryEngine(
        retriever,
        response_synthesizer=RagFixSynthesizer(marginalize_orders(backend, OrderOptions(orders=3))),
        node_postprocessors=[RagFixPostprocessor(strategy="none", backend=backend)],
    )

Unlike ``RagFixLLM(passages_from=post)``, which reads the postprocessor's last call, each query
is answered over its own chunks, so concurrent ``aquery`` calls on one engine cannot read each
other's passages.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from llama_index.core.llms import MockLLM
from llama_index.core.response_synthesizers.base import BaseSynthesizer

from ragfix.answering import Answerer, AnswerSettings
from ragfix.backends.base import Backend
from ragfix.tasks import get_task, join_chunks


class RagFixSynthesizer(BaseSynthesizer):
    """Answer each query over its own chunks with ``backend`` (see the module docstring).

    Args:
        backend: any ragfix backend.
        task: the QA task whose prompt and answer rules are used (default ``qa``: its
            instruction, documents and ``Question: ...\\nAnswer:``; its budget and newline
            stop unless ``settings`` say otherwise).
        **settings: answer settings (:class:`~ragfix.answering.AnswerSettings`:
            ``max_new_tokens``, ``context_window``, ``stop_at_newline``, ``prefix_reuse``).

    Raises:
        ConfigError: an unknown or non-QA task, settings that leave no room for a prompt.
        pydantic.ValidationError: an unknown setting.
    """

    def __init__(self, backend: Backend, task: str = "qa", **settings: Any) -> None:
        the_task = get_task(task)
        if the_task.data_format != "qa":
            from ragfix.errors import ConfigError

            raise ConfigError(f"RagFixSynthesizer answers a QA task, not {task!r}")
        rules = {
            "max_new_tokens": the_task.max_new_tokens,
            "stop_at_newline": the_task.stop_at_newline,
        }
        answer = AnswerSettings(**{**rules, **settings, "use_chat_template": True})
        super().__init__(llm=MockLLM())
        self._task = the_task
        self._answerer = Answerer(
            answer, backend, who="RagFixSynthesizer", calls_give_passages=True
        )
        self._lock = threading.Lock()  # one backend, one call at a time

    def _get_prompts(self) -> dict:
        return {}

    def _update_prompts(self, prompts: dict) -> None:
        return None

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        """The backend's greedy answer to the task prompt of ``query_str`` over ``text_chunks``
        (in their order; blank ones left out).

        Raises:
            ConfigError: the prompt does not fit the backend's window (never truncated).
        """
        chunks = [c.strip() for c in text_chunks if c.strip()]
        user = self._task.user_turn(query_str, join_chunks(chunks))
        with self._lock:
            return self._answerer.generate(user, passages=chunks).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        """:meth:`get_response` in a worker thread (the event loop stays free)."""
        import asyncio

        return await asyncio.to_thread(self.get_response, query_str, text_chunks)


__all__ = ["RagFixSynthesizer"]
