"""The ``gali`` method: training-free context extension by Greedy Attention Logit Interpolation
(arXiv 2502.02659).

* :mod:`.options`: :class:`GaliOptions` and the default and paper chunk sizes.
* :mod:`.backend`: GALI's positions, chunks and attention and :class:`GaliBackend`.
"""

from ragfix.backends.gali.backend import (
    GaliBackend,
    GaliLayout,
    chunk_sizes,
    gali_layout,
    gali_positions,
    paper_logits,
)
from ragfix.backends.gali.options import (
    DEFAULT_CHUNK_FRACTION,
    GaliOptions,
    default_chunk_size,
    paper_setting,
)

__all__ = [
    "DEFAULT_CHUNK_FRACTION",
    "GaliBackend",
    "GaliLayout",
    "GaliOptions",
    "chunk_sizes",
    "default_chunk_size",
    "gali_layout",
    "gali_positions",
    "paper_logits",
    "paper_setting",
]
