"""Judge prompt templates: the MT-bench pairwise layout with the ``[[A]]`` / ``[[B]]`` / ``[[C]]``
verdict format (Zheng et al., NeurIPS 2023 Datasets and Benchmarks, "Judging LLM-as-a-Judge with
MT-Bench and Chatbot Arena", section 3.1; FastChat ``pair-v2`` / ``pair-math-v1``).
"""

from __future__ import annotations

import hashlib

from ragfix.errors import ConfigError

_INSTRUCTIONS = (
    "You are a fair judge. Two AI assistants answered the user question below. Decide which "
    "answer follows the user's instructions and answers the question better: consider whether "
    "it is correct, helpful, relevant and precise. The order in which the answers are shown "
    "must not influence you, and neither must their length or the assistants' names."
)
_REFERENCE_NOTE = (
    " A reference answer is given: compare both answers with it and treat any departure from "
    "it as a mistake."
)
_EXPLAIN = (
    " First compare the two answers in a short explanation. Then give your final verdict in "
    'exactly this format: "[[A]]" if assistant A is better, "[[B]]" if assistant B is better, '
    'or "[[C]]" for a tie.'
)
_VERDICT_ONLY = (
    ' Reply with your verdict only, in exactly this format: "[[A]]" if assistant A is better, '
    '"[[B]]" if assistant B is better, or "[[C]]" for a tie.'
)

_ANSWER_ONLY = " Reply with the better answer only, copied exactly as it is written."

#: prompt styles: ``explain`` = MT-bench pair-v2 style (explanation, then the verdict; for judges
#: that follow instructions), ``verdict`` = the verdict only, with the assistant turn prefilled
#: with ``[[`` so the next token is the verdict letter (small models; gives the logit verdict),
#: ``answer`` = the better answer copied as the reply, the assistant turn prefilled with
#: :data:`ANSWER_PREFIX`: each answer's likelihood as that reply is the verdict (no letter).
STYLES = ("verdict", "explain", "answer")


def judge_prompt(
    question: str,
    first: str,
    second: str,
    reference: str | None = None,
    style: str = "verdict",
    labels: tuple[str, str] = ("A", "B"),
) -> str:
    """The user turn of an MT-bench style pairwise judge prompt, ``first`` in the first slot.

    Laid out as FastChat's ``pair-v2`` / ``pair-math-v1`` templates (Zheng et al. 2023): the
    question, an optional reference answer, then the two answers in marked blocks; the verdict
    format is ``[[A]]`` / ``[[B]]`` / ``[[C]]``.

    Args:
        labels: the assistant letters of the first and the second block: ``("A", "B")``
            (the MT-bench layout) or ``("B", "A")`` (letters assigned by content,
            :func:`content_labels`).

    Raises:
        ConfigError: unknown ``style``, or ``labels`` not ``("A", "B")`` / ``("B", "A")``.
    """
    if sorted(labels) != ["A", "B"]:
        raise ConfigError(f"judge prompt labels must be A and B, got {labels!r}")
    if style not in STYLES:
        raise ConfigError(
            f"unknown judge prompt style {style!r}; choose one of: {', '.join(STYLES)}"
        )
    head = _INSTRUCTIONS + (_REFERENCE_NOTE if reference else "")
    head += {"explain": _EXPLAIN, "verdict": _VERDICT_ONLY, "answer": _ANSWER_ONLY}[style]
    parts = [head, f"[User Question]\n{question}"]
    if reference:
        parts.append(f"[The Start of Reference Answer]\n{reference}\n[The End of Reference Answer]")
    parts += [answer_block(labels[0], first), answer_block(labels[1], second)]
    return ANSWER_SEPARATOR.join(parts)


#: what joins the blocks of a judge prompt (and so the two answer blocks)
ANSWER_SEPARATOR = "\n\n"


def answer_block(slot: str, answer: str) -> str:
    """One answer in its marked block, labelled with its slot (``A`` or ``B``)."""
    name = f"Assistant {slot}'s Answer"
    return f"[The Start of {name}]\n{answer}\n[The End of {name}]"


def answer_spans(
    user: str, labels: tuple[str, str] = ("A", "B")
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The character spans of the two answer blocks (labels included) at the end of a
    :func:`judge_prompt` user turn laid out with ``labels``: what a backend reading passages as
    a set reads as a set."""
    second = user.rindex(f"[The Start of Assistant {labels[1]}'s Answer]")
    first = user.rindex(f"[The Start of Assistant {labels[0]}'s Answer]", 0, second)
    return (first, second - len(ANSWER_SEPARATOR)), (second, len(user))


def content_labels(first: str, second: str) -> tuple[str, str]:
    """Assistant letters that carry no order: each answer's letter follows from its text alone
    (``A`` for the answer whose SHA-256 is the smaller), so an answer keeps its letter in both
    orders and a judge's prior for a letter no longer falls on a slot.

    Returns:
        the letters of ``first`` and ``second``: ``("A", "B")`` or ``("B", "A")`` (identical
        answers: ``("A", "B")``).
    """
    ha, hb = (hashlib.sha256(t.encode()).hexdigest() for t in (first, second))
    return ("A", "B") if ha <= hb else ("B", "A")


#: the assistant-turn prefix of the ``verdict`` style (the verdict letter comes next)
VERDICT_PREFIX = "[["
#: the assistant-turn prefix of the ``answer`` style; an answer is scored as what follows it,
#: after one space (the continuation then starts on a token boundary)
ANSWER_PREFIX = "The better answer is:"
