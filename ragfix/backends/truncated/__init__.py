"""The ``truncated`` baseline: the unmodified model held to a window, prompts cut in the middle.

* :mod:`.options`: :class:`TruncatedOptions`.
* :mod:`.backend`: :func:`truncate_middle` and :class:`TruncatedBackend`.
"""

from ragfix.backends.truncated.backend import TruncatedBackend, truncate_middle
from ragfix.backends.truncated.options import TruncatedOptions

__all__ = ["TruncatedBackend", "TruncatedOptions", "truncate_middle"]
