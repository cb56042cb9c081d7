"""The request a backend answers: :class:`TaskPrompt` (bottom layer of the model interface).

The prompts themselves are built from task records (:mod:`ragfix.tasks`) and the judge's
templates (:mod:`ragfix.judge.prompts`); this module holds only the request type, so that
:mod:`ragfix.backends` can import it without the task registry. A prompt built there knows where
its passages are (:attr:`TaskPrompt.passages`), so a backend that reads the passages as a set
(``set-based``, ``pine``) can find them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskPrompt:
    """What a backend needs to produce one answer.

    Attributes:
        user: the user turn (the filled template).
        assistant_prefix: text the assistant turn is prefilled with (the answer's opening).
        max_new_tokens: generation budget.
        stop_at_newline: stop at the first newline (short-answer tasks).
        passages: the character spans ``(start, end)`` in ``user`` of each passage as rendered
            (its label, ``Document [i](Title: ...)``, included; what joins two passages left
            out), in prompt order, non-overlapping; ``()`` when the prompt does not know its
            passages (a framework's or a client's text).
        passage_separator: what the template puts between two passages (``"\n"`` for QA);
            a backend that reads the passages as a set gives every passage this ending.

    Raises:
        ValueError: spans out of ``user``, empty, overlapping or out of order.
    """

    user: str
    assistant_prefix: str = ""
    max_new_tokens: int = 32
    stop_at_newline: bool = True
    passages: tuple[tuple[int, int], ...] = ()
    passage_separator: str = ""

    def __post_init__(self) -> None:
        end = 0
        for start, stop in self.passages:
            if not end <= start < stop <= len(self.user):
                raise ValueError(
                    f"passage span {(start, stop)} is empty, overlaps the one before or lies "
                    f"outside the {len(self.user)}-character user turn"
                )
            end = stop

    def passage_texts(self) -> list[str]:
        """The passages as rendered, in prompt order (``user[start:end]`` of each span)."""
        return [self.user[a:b] for a, b in self.passages]


__all__ = ["TaskPrompt"]
