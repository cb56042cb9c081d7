"""Prompt templates: Lost-in-the-Middle multi-document QA and KV retrieval.

Both are the templates of Lost in the Middle (Liu et al., TACL 2024, ``prompts/qa.prompt`` and
``prompts/kv_retrieval.prompt``). A template turns a sample and an ordered passage list into a
:class:`TaskPrompt`; the backend wraps the user text in the model's chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ragfix.metrics import best_subspan_em, kv_match
from ragfix.types import Passage, QASample

QA_INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below."


@dataclass(frozen=True)
class TaskPrompt:
    """What a backend needs to produce one answer.

    Attributes:
        user: the user turn (the filled template).
        assistant_prefix: text the assistant turn is prefilled with (the answer's opening).
        max_new_tokens: generation budget.
        stop_at_newline: stop at the first newline (short-answer tasks).
    """

    user: str
    assistant_prefix: str = ""
    max_new_tokens: int = 32
    stop_at_newline: bool = True


def render_document(index: int, passage: Passage) -> str:
    """``Document [i](Title: ...) text`` with a 1-based index."""
    return f"Document [{index}](Title: {passage.title}) {passage.text}"


def qa_prompt(question: str, passages: list[Passage]) -> str:
    """The Lost-in-the-Middle multi-document QA prompt, documents numbered from 1."""
    docs = "\n".join(render_document(i + 1, p) for i, p in enumerate(passages))
    return f"{QA_INSTRUCTION}\n\n{docs}\n\nQuestion: {question}\nAnswer:"


def kv_prompt(key: str, pairs: list[Passage]) -> str:
    """The Lost-in-the-Middle KV-retrieval prompt; ``pairs`` carry key in ``title``, value in
    ``text``, rendered as one JSON object with one pair per line."""
    body = ",\n ".join(f"{json.dumps(p.title)}: {json.dumps(p.text)}" for p in pairs)
    return (
        f"{KV_INSTRUCTION}\n\nJSON data:\n{{{body}}}\n\n"
        f"Key: {json.dumps(key)}\nCorresponding value:"
    )


def kv_answer_prefix(key: str) -> str:
    """Assistant prefill for KV retrieval. Small chat models answer in format only when the
    assistant turn opens with the answer's first words (measured on SmolLM2-135M-Instruct)."""
    return f'The value of key {json.dumps(key)} is "'


def task_prompt(sample: QASample, passages: list[Passage]) -> TaskPrompt:
    """The prompt for ``sample`` with its context in the given order."""
    if sample.task == "kv":
        return TaskPrompt(
            user=kv_prompt(sample.question, passages),
            assistant_prefix=kv_answer_prefix(sample.question),
            max_new_tokens=40,
            stop_at_newline=False,
        )
    return TaskPrompt(user=qa_prompt(sample.question, passages), max_new_tokens=32)


def score_answer(sample: QASample, answer: str) -> bool:
    """best_subspan_em for QA; value containment for KV."""
    if sample.task == "kv":
        return kv_match(answer, sample.answers[0])
    return best_subspan_em(answer, sample.answers)
