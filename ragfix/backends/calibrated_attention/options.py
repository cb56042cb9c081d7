"""The options of the ``calibrated-attention`` backend and the paper's temperature."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ragfix.backends.base import BackendOptions

#: the paper's temperature (Appendix B)
PAPER_TEMPERATURE = 5e-5


class CalibratedAttentionOptions(BackendOptions):
    """Options of the ``calibrated-attention`` backend.

    Attributes:
        layers: the calibrated layers: ``upper`` (``L // 2 .. L - 1``) or ``all``.
        temperature: ``t`` of ``softmax(r / t)`` (> 0; the paper's 5e-5 by default): lower
            gives the most relevant passage more of the passages' mass.
        heads: ``each``: every head redistributes by its own relevance ``r``; ``mean``: by the
            relevance averaged over the layer's heads (one ranking of the passages per layer and
            reader, each head keeping its own passage mass ``M``).
    """

    layers: Literal["upper", "all"] = "upper"
    temperature: float = Field(default=PAPER_TEMPERATURE, gt=0)
    heads: Literal["each", "mean"] = "each"
