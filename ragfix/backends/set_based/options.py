"""The options of the ``set-based`` backend."""

from __future__ import annotations

from typing import Literal

from ragfix.backends.base import BackendOptions


class SetBasedOptions(BackendOptions):
    """Options of the ``set-based`` backend.

    Attributes:
        align: where the parallel positions of the passages sit: ``end`` (each ends next to the
            question) or ``start`` (each starts after the prefix, as in the paper).
    """

    align: Literal["start", "end"] = "end"
