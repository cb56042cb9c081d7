"""The ``set-based`` method: a prompt's passages read as a set, order-invariant in one forward
pass (arXiv 2406.06581).

* :mod:`.options`: :class:`SetBasedOptions`.
* :mod:`.backend`: the block mask (:func:`set_visibility`) and :class:`SetBasedBackend`.
"""

from ragfix.backends.set_based.backend import SetBasedBackend, set_visibility
from ragfix.backends.set_based.options import SetBasedOptions

__all__ = ["SetBasedBackend", "SetBasedOptions", "set_visibility"]
