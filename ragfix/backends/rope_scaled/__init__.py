"""The ``rope-scaled`` baselines: transformers' own RoPE scaling (linear, dynamic NTK, YaRN).

* :mod:`.options`: :class:`RopeScaledOptions`.
* :mod:`.backend`: :class:`RopeScaledBackend`.
"""

from ragfix.backends.rope_scaled.backend import RopeScaledBackend
from ragfix.backends.rope_scaled.options import RopeScaledOptions

__all__ = ["RopeScaledBackend", "RopeScaledOptions"]
