"""The ``pine`` method: passages read order-invariantly, positions re-assigned by importance
(arXiv 2407.01100). No options; :mod:`.backend` holds the attention patch and
:class:`PineBackend`.
"""

from ragfix.backends.pine.backend import PineBackend, passage_shifts

__all__ = ["PineBackend", "passage_shifts"]
