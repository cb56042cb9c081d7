"""The options of the ``rope-scaled`` backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ragfix.backends.base import BackendOptions


class RopeScaledOptions(BackendOptions):
    """Options of the ``rope-scaled`` backend.

    Attributes:
        rope_type: ``linear``, ``dynamic`` (NTK) or ``yarn``.
        factor: the window stretch; the reported ``context_window`` is ``factor * train_window``.
        train_window: the trained window the scaling starts from (default: the model's
            ``max_position_embeddings``; lower it to compare with GALI at the same lowered window).
    """

    rope_type: Literal["linear", "dynamic", "yarn"] = "yarn"
    factor: float = Field(4.0, gt=1.0)
    train_window: int | None = Field(None, ge=2)
