"""Tasks as data: one record per task, one registry (in the spirit of lm-evaluation-harness).

A :class:`Task` holds everything that turns a question and an ordered passage list into what a
backend reads (:class:`~ragfix.prompts.TaskPrompt`) and an answer into a score: the instruction,
the user-turn template, how one passage is rendered and how passages are joined, the assistant
prefix, the answer budget, the stop rule and the scorer. Every prompt of ragfix is built here:
the sweep (:func:`task_prompt`), attention sorting (:meth:`Task.user_turn` with a marker) and the
LlamaIndex text-QA prompt (:meth:`Task.llama_index_template`), so each template exists once.

Built in, both from Lost in the Middle (Liu et al., TACL 2024, ``prompts/qa.prompt`` and
``prompts/kv_retrieval.prompt``):

* ``qa``: multi-document question answering, scored by best_subspan_em;
* ``kv``: key-value retrieval over a JSON object, scored by value containment.

A new task is one :func:`register_task` call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ragfix.errors import ConfigError
from ragfix.metrics import best_subspan_em, kv_match
from ragfix.prompts import CONTENT_FREE_QUERY, TaskPrompt
from ragfix.types import Passage, QASample

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."


def render_document(index: int, passage: Passage) -> str:
    """A QA passage: ``Document [i](Title: ...) text`` with a 1-based ``index``."""
    return f"Document [{index}](Title: {passage.title}) {passage.text}"


def render_kv_pair(index: int, passage: Passage) -> str:
    """A KV pair (key in ``title``, value in ``text``) as one JSON object member; ``index`` is
    unused (the JSON object is unnumbered)."""
    return f"{json.dumps(passage.title)}: {json.dumps(passage.text)}"


def kv_answer_prefix(key: str) -> str:
    """Assistant prefill for KV retrieval. Small chat models answer in format only when the
    assistant turn opens with the answer's first words (measured on SmolLM2-135M-Instruct)."""
    return f'The value of key {json.dumps(key)} is "'


def kv_completion_prefix(key: str) -> str:
    """Base-model form of KV retrieval: the value opens with its quote right after
    ``Corresponding value:`` (Liu et al., "Lost in the Middle", TACL 2024, Sec. 3)."""
    return ' "'


def _no_prefix(question: str) -> str:
    return ""


def _same(question: str) -> str:
    return question


def _kv_score(answer: str, answers: Sequence[str]) -> bool:
    return kv_match(answer, answers[0])


@dataclass(frozen=True)
class Task:
    """A task as data.

    Attributes:
        name: registry name (``QASample.task``).
        instruction: the instruction at the head of the user turn.
        template: the user turn, with the fields ``{instruction}``, ``{context}`` (the rendered
            passages) and ``{question}`` (the rendered question).
        render_passage: ``(1-based index, passage) -> text`` of one passage.
        separator: what joins the rendered passages into ``{context}``.
        render_question: question -> the text put into ``{question}`` (e.g. a JSON-quoted key).
        assistant_prefix: question -> the text the assistant turn is prefilled with.
        completion_prefix: question -> what follows the filled template for a base model (no
            chat template): the template itself ends where the answer starts.
        max_new_tokens: answer budget (tokens).
        stop_at_newline: the answer ends at its first newline.
        scorer: ``(answer, gold answers) -> correct``.
    """

    name: str
    instruction: str
    template: str
    render_passage: Callable[[int, Passage], str]
    separator: str = "\n"
    render_question: Callable[[str], str] = _same
    assistant_prefix: Callable[[str], str] = _no_prefix
    completion_prefix: Callable[[str], str] = _no_prefix
    max_new_tokens: int = 32
    stop_at_newline: bool = True
    scorer: Callable[[str, Sequence[str]], bool] = best_subspan_em

    def passage_texts(self, passages: Sequence[Passage]) -> list[str]:
        """Each passage rendered with its 1-based index, the separator attached to every one but
        the last, so that ``"".join(...)`` is the ``{context}`` of :meth:`user_turn`."""
        last = len(passages) - 1
        return [
            self.render_passage(i + 1, p) + (self.separator if i < last else "")
            for i, p in enumerate(passages)
        ]

    def user_turn(self, question: str, passages: Sequence[Passage] | str) -> str:
        """The filled template; ``passages`` in prompt order, or a ready ``{context}`` string
        (e.g. a marker where attention sorting cuts the prompt)."""
        context = passages if isinstance(passages, str) else "".join(self.passage_texts(passages))
        return self.template.format(
            instruction=self.instruction,
            context=context,
            question=self.render_question(question),
        )

    def prompt(self, question: str, passages: Sequence[Passage] | str) -> TaskPrompt:
        """The :class:`TaskPrompt` of ``question`` with ``passages`` in the given order; given
        as passages (not a ready context string) it knows their spans
        (:attr:`TaskPrompt.passages`), the separator and its content-free forms
        (:attr:`TaskPrompt.no_query`, :attr:`TaskPrompt.no_content`)."""
        core = self._prompt(question, passages)
        if not core.passages:
            return core
        blank = [Passage(title="", text="") for _ in passages]
        return replace(
            core,
            no_query=self._prompt(CONTENT_FREE_QUERY, passages),
            no_content=self._prompt(CONTENT_FREE_QUERY, blank),
        )

    def _prompt(self, question: str, passages: Sequence[Passage] | str) -> TaskPrompt:
        user = self.user_turn(question, passages)
        spans: tuple[tuple[int, int], ...] = ()
        if not isinstance(passages, str) and passages:
            marker = "\x00"  # never in a template: where the context starts
            head = self.template.format(
                instruction=self.instruction,
                context=marker,
                question=self.render_question(question),
            ).split(marker)[0]
            start, out = len(head), []
            for i, p in enumerate(passages):
                text = self.render_passage(i + 1, p)
                out.append((start, start + len(text)))
                start += len(text) + len(self.separator)
            spans = tuple(out)
        return TaskPrompt(
            user=user,
            assistant_prefix=self.assistant_prefix(question),
            completion_prefix=self.completion_prefix(question),
            max_new_tokens=self.max_new_tokens,
            stop_at_newline=self.stop_at_newline,
            passages=spans,
            passage_separator=self.separator if spans else "",
        )

    def score(self, answer: str, answers: Sequence[str]) -> bool:
        """Whether ``answer`` is correct for the gold ``answers``."""
        return bool(self.scorer(answer, answers))

    def placeholder_template(self, context: str, question: str) -> str:
        """The user turn with the instruction filled in and the given placeholders where the
        context and the question go (the question is inserted as it is, so this suits tasks
        whose ``render_question`` is the identity)."""
        return self.template.format(
            instruction=self.instruction, context=context, question=question
        )

    def llama_index_template(self) -> str:
        """The user turn as a LlamaIndex text-QA prompt string: ``{context_str}`` where the
        passages go, ``{query_str}`` where the question goes."""
        return self.placeholder_template("{context_str}", "{query_str}")


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Register ``task`` under ``task.name`` (a later registration replaces an earlier one).

    Returns:
        ``task``.
    """
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The task registered under ``name``.

    Raises:
        ConfigError: unknown task (the message lists the known ones).
    """
    if name not in _TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(sorted(_TASKS))}")
    return _TASKS[name]


QA = register_task(
    Task(
        name="qa",
        instruction=QA_INSTRUCTION,
        template="{instruction}\n\n{context}\n\nQuestion: {question}\nAnswer:",
        render_passage=render_document,
    )
)
KV = register_task(
    Task(
        name="kv",
        instruction=KV_INSTRUCTION,
        template=(
            "{instruction}\n\nJSON data:\n{{{context}}}\n\nKey: {question}\nCorresponding value:"
        ),
        render_passage=render_kv_pair,
        separator=",\n ",
        render_question=json.dumps,
        assistant_prefix=kv_answer_prefix,
        completion_prefix=kv_completion_prefix,
        max_new_tokens=40,
        stop_at_newline=False,
        scorer=_kv_score,
    )
)


CHUNK_TEMPLATE = "Document (Title: {title}) {text}"
"""How a retrieved chunk reads in a pipeline's prompt (the Lost-in-the-Middle document line)."""
CHUNK_SEPARATOR = "\n\n"
"""What joins the chunks of a pipeline's prompt."""


def render_chunk(title: str, text: str) -> str:
    """A retrieved chunk as the LLM reads it in a pipeline (LlamaIndex renders its nodes with the
    same template, :data:`CHUNK_TEMPLATE`): ``Document (Title: t) text``, or the bare text for a
    chunk without a title (as LlamaIndex leaves a node without metadata)."""
    return CHUNK_TEMPLATE.format(title=title, text=text) if title.strip() else text


def join_chunks(chunks: Sequence[str]) -> str:
    """The ``{context}`` of a pipeline's prompt: the rendered chunks, each stripped, blank ones
    left out, joined by :data:`CHUNK_SEPARATOR` (how LlamaIndex's ``compact`` synthesis packs a
    context that fits one prompt), so every framework gives the model the same text."""
    return CHUNK_SEPARATOR.join(c.strip() for c in chunks if c.strip())


def task_prompt(sample: QASample, passages: Sequence[Passage]) -> TaskPrompt:
    """The prompt for ``sample`` with its context in the given order (its task's record).

    Raises:
        ConfigError: ``sample.task`` is not a registered task.
    """
    return get_task(sample.task).prompt(sample.question, passages)


def score_answer(sample: QASample, answer: str) -> bool:
    """Score ``answer`` with the scorer of ``sample``'s task (best_subspan_em for QA, value
    containment for KV).

    Raises:
        ConfigError: ``sample.task`` is not a registered task.
    """
    return get_task(sample.task).score(answer, sample.answers)


__all__ = [
    "CHUNK_SEPARATOR",
    "CHUNK_TEMPLATE",
    "KV",
    "KV_INSTRUCTION",
    "QA",
    "QA_INSTRUCTION",
    "Task",
    "get_task",
    "join_chunks",
    "kv_answer_prefix",
    "register_task",
    "render_chunk",
    "render_document",
    "render_kv_pair",
    "score_answer",
    "task_prompt",
]
