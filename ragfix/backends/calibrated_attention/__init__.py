"""The ``calibrated-attention`` method: Found in the Middle, the attention to each passage minus
its content-free positional bias (arXiv 2406.16008).

* :mod:`.options`: :class:`CalibratedAttentionOptions` and the paper's temperature.
* :mod:`.backend`: the calibrated attention patch and :class:`CalibratedAttentionBackend`.
"""

from ragfix.backends.calibrated_attention.backend import CalibratedAttentionBackend, ReaderLayout
from ragfix.backends.calibrated_attention.options import (
    PAPER_TEMPERATURE,
    CalibratedAttentionOptions,
)

__all__ = [
    "PAPER_TEMPERATURE",
    "CalibratedAttentionBackend",
    "CalibratedAttentionOptions",
    "ReaderLayout",
]
