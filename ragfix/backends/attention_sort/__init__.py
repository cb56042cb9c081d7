"""The ``attention-sort`` method: a task prompt's passages sorted by the attention the model pays
them, calibrated or not, before it answers (attention sorting: arXiv 2310.01427; readers and
calibration: ICR, arXiv 2410.02642).

* :mod:`.options`: :class:`AttentionSortOptions` and the per-model ``place`` defaults
  (:data:`PLACE_DEFAULTS`).
* :mod:`.backend`: the passage attention, its scores, the sort and
  :class:`AttentionSortBackend`.
* :mod:`.tune`: ``ragfix tune attention-sort``, the choice of the options' defaults on a tune
  range (imported by itself: ``ragfix.backends.attention_sort.tune``).
"""

from ragfix.backends.attention_sort.backend import (
    AttentionSortBackend,
    combine_scores,
    passage_attention,
    passage_scores,
    sort_passages,
)
from ragfix.backends.attention_sort.options import (
    PLACE_DEFAULTS,
    AttentionSortOptions,
    default_place,
    with_place,
)

__all__ = [
    "PLACE_DEFAULTS",
    "AttentionSortBackend",
    "AttentionSortOptions",
    "combine_scores",
    "default_place",
    "passage_attention",
    "passage_scores",
    "sort_passages",
    "with_place",
]
