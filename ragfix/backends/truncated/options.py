"""The options of the ``truncated`` backend."""

from __future__ import annotations

from pydantic import Field

from ragfix.backends.base import BackendOptions


class TruncatedOptions(BackendOptions):
    """Options of the ``truncated`` backend.

    Attributes:
        train_window: the window in tokens (prompt plus answer; default: the model's
            ``max_position_embeddings``).
        score_stride: tokens scored per sliding window when scoring a text longer than the
            window (default ``train_window // 4``); must be below ``train_window``.
    """

    train_window: int | None = Field(None, ge=2)
    score_stride: int | None = Field(None, ge=1)
