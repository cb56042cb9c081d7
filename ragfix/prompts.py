"""The request a backend answers: :class:`TaskPrompt` (bottom layer of the model interface).

The prompts themselves are built from task records (:mod:`ragfix.tasks`); this module holds only
the request type, so that :mod:`ragfix.backends` can import it without the task registry.
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
    """

    user: str
    assistant_prefix: str = ""
    max_new_tokens: int = 32
    stop_at_newline: bool = True


__all__ = ["TaskPrompt"]
