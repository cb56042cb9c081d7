"""The request a backend answers: :class:`TaskPrompt` (bottom layer of the model interface).

The prompts themselves are built from task records (:mod:`ragfix.tasks`) and the judge's
templates (:mod:`ragfix.judge.prompts`); this module holds only the request type, so that
:mod:`ragfix.backends` can import it without the task registry. A prompt built there knows where
its passages are (:attr:`TaskPrompt.passages`), so a backend that reads the passages as a set
(``set-based``, ``pine``) can find them; a text built elsewhere (a framework's rendered prompt)
has them found in it by :func:`find_passages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

#: the content-free query of in-context re-ranking (Chen et al., arXiv 2410.02642, Sec. 3.2)
CONTENT_FREE_QUERY = "N/A"


def join_text_parts(parts: Sequence[str]) -> str:
    """The text of a message written in parts (OpenAI's ``content: [{"type": "text", ...}]``,
    a LangChain message's text blocks, a Haystack message's text parts): the parts in order,
    with nothing put between them (``["What is the capital", " of France?"]`` reads ``"What is
    the capital of France?"``). ``ragfix serve`` and the LangChain and Haystack components read
    a message's parts by this one rule."""
    return "".join(parts)


def find_passages(text: str, chunks: Sequence[str]) -> list[tuple[int, int] | None]:
    """Where each of ``chunks`` stands verbatim in ``text`` (a prompt a framework rendered from
    them).

    Each chunk is searched stripped of surrounding white space, from the end of the last chunk
    found before it (so a text repeated in two chunks is found twice, in order, and the spans
    found never overlap).

    Returns:
        per chunk, in the order of ``chunks``: the character span ``(start, end)`` of its
        stripped text in ``text``, or ``None`` when it is not there after the chunks found
        before it, or is blank. The spans found are increasing and non-overlapping, as
        :attr:`TaskPrompt.passages` takes them.
    """
    out: list[tuple[int, int] | None] = []
    start = 0
    for chunk in chunks:
        needle = chunk.strip()
        at = text.find(needle, start) if needle else -1
        if at < 0:
            out.append(None)
            continue
        start = at + len(needle)
        out.append((at, start))
    return out


#: what a run's identity records as the chat template of a model without one (a base model),
#: which reads a task prompt in its completion form (:meth:`TaskPrompt.answer_prefix`) after
#: the tokenizer's BOS (:func:`ragfix.backends.hf.chat_text`); a folder written when that form
#: had no BOS records ``"none: the task's completion form"`` and is not resumed
NO_CHAT_TEMPLATE = "none: the task's completion form after the tokenizer's BOS"


@dataclass(frozen=True)
class TaskPrompt:
    """What a backend needs to produce one answer.

    Attributes:
        user: the user turn (the filled template).
        assistant_prefix: text the assistant turn is prefilled with (the answer's opening).
        completion_prefix: the task's base-model form: what follows ``user`` for a model
            without a chat template, which reads the filled template as a document to continue
            (KV: `` "``, after ``Corresponding value:``); ``None`` when the prompt has no such
            form (then: a newline and ``assistant_prefix``).
        max_new_tokens: generation budget.
        stop_at_newline: stop at the first newline (short-answer tasks).
        passages: the character spans ``(start, end)`` in ``user`` of each passage as rendered
            (its label, ``Document [i](Title: ...)``, included; what joins two passages left
            out), in prompt order, non-overlapping; ``()`` when the prompt does not know its
            passages (a framework's or a client's text), or has none (:attr:`closed_book`).
        closed_book: a task prompt built without passages on purpose (a sweep's closed-book
            reference point): it knows it has none, so a backend that acts on passages reads it
            as the model does, where a prompt that does not know its passages is refused.
        passage_separator: what the template puts between two passages (``"\n"`` for QA);
            a backend that reads the passages as a set gives every passage this ending.
        no_query: the same prompt with the content-free query of in-context re-ranking
            (:data:`CONTENT_FREE_QUERY` in place of the question; Chen et al., arXiv 2410.02642,
            Sec. 3.2): the same passages at the same spans, for a backend that subtracts the
            attention a content-free query pays them; ``None`` when not built.
        no_content: the same template with every passage content-free (empty title and
            text) and the content-free query: it depends only on the template and the number of
            passages, so a per-slot attention bias measured on it can be cached (Found in the
            Middle, Hsieh et al., arXiv 2406.16008, Sec. 4); ``None`` when not built.

    Raises:
        ValueError: spans out of ``user``, empty, overlapping or out of order.
    """

    user: str
    assistant_prefix: str = ""
    completion_prefix: str | None = None
    max_new_tokens: int = 32
    stop_at_newline: bool = True
    passages: tuple[tuple[int, int], ...] = ()
    passage_separator: str = ""
    closed_book: bool = False
    no_query: TaskPrompt | None = None
    no_content: TaskPrompt | None = None

    def __post_init__(self) -> None:
        if self.closed_book and self.passages:
            raise ValueError("a closed-book prompt has no passage spans")
        end = 0
        for start, stop in self.passages:
            if not end <= start < stop <= len(self.user):
                raise ValueError(
                    f"passage span {(start, stop)} is empty, overlaps the one before or lies "
                    f"outside the {len(self.user)}-character user turn"
                )
            end = stop

    def answer_prefix(self, chat: bool = True) -> str:
        """What the model reads between :attr:`user` and its answer: in a chat template
        (``chat``), the assistant turn's prefill (:attr:`assistant_prefix`); in the completion
        form of a model without one, :attr:`completion_prefix`, or a newline and
        :attr:`assistant_prefix` for a prompt without a completion form."""
        if chat:
            return self.assistant_prefix
        if self.completion_prefix is not None:
            return self.completion_prefix
        return "\n" + self.assistant_prefix

    def passage_texts(self) -> list[str]:
        """The passages as rendered, in prompt order (``user[start:end]`` of each span)."""
        return [self.user[a:b] for a, b in self.passages]

    def reordered(self, order: Sequence[int]) -> TaskPrompt:
        """The prompt with its passages in ``order`` (``order[j]`` = the index of the passage
        put at position ``j``): each passage moves with its label, the text between passages
        stays where it is, the spans are those of the new text; :attr:`no_query` is reordered
        the same way, :attr:`no_content` (content-free) is kept.

        Raises:
            ValueError: ``order`` is not a permutation of the passages' indices.
        """
        n = len(self.passages)
        if sorted(order) != list(range(n)):
            raise ValueError(f"order {list(order)} is not a permutation of range({n})")
        texts = self.passage_texts()
        gaps = [
            self.user[a[1] : b[0]] for a, b in zip(self.passages, self.passages[1:], strict=False)
        ]
        user, spans = self.user[: self.passages[0][0]] if n else self.user, []
        for j, i in enumerate(order):
            spans.append((len(user), len(user) + len(texts[i])))
            user += texts[i] + (gaps[j] if j < n - 1 else "")
        if n:
            user += self.user[self.passages[-1][1] :]
        return replace(
            self,
            user=user,
            passages=tuple(spans),
            no_query=None if self.no_query is None else self.no_query.reordered(order),
        )


__all__ = ["CONTENT_FREE_QUERY", "TaskPrompt", "find_passages", "join_text_parts"]
