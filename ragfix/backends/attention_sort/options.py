"""The options of the ``attention-sort`` backend and its per-model ``place`` defaults."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ragfix.backends.base import BackendOptions


class AttentionSortOptions(BackendOptions):
    """Options of the ``attention-sort`` backend.

    Attributes:
        layers: the layers whose scores are averaged: ``upper`` (the upper half, ``L // 2`` on)
            or ``all``.
        calibrate: subtract the attention the content-free query pays the same passages (ICR).
        rounds: sorting rounds (each reads the prompt as the previous round left it).
        place: where the most attended passage goes: ``last`` (ascending order, next to the
            question: the paper's order) or ``first`` (descending). ``None``: the model's
            measured default (:data:`PLACE_DEFAULTS`), else ``last``; the value used is in the
            backend's options (and so in a run's identity).

    The defaults (``upper``, calibrated, one round) are the measured best of ``ragfix tune
    attention-sort`` on the tune range of KV retrieval (``results/kv8-tune-attention-sort.json``);
    ``place`` is the better of the model's first and last positions on the same tune range
    (vanilla), since one sort round puts the most attended passage there.
    """

    layers: Literal["upper", "all"] = "upper"
    calibrate: bool = True
    rounds: int = Field(default=1, ge=1)
    place: Literal["last", "first"] | None = None


#: measured ``place`` defaults by model name (the ragfix alias and the hub id of the same
#: weights): the better of the model's first and last positions in vanilla on the tune range of
#: KV retrieval (the 140-key file's records 0-29, 8 pairs, every position). SmolLM2's best is
#: last (``results/kv8-tune-vanilla.json``), Gemma 3 270M base's first (read with its BOS:
#: ``results/gemma3-bos-kv8-tune30-vanilla.json``); any other model: ``last``
PLACE_DEFAULTS: dict[str, Literal["last", "first"]] = {
    "gemma3-270m": "first",
    "google/gemma-3-270m": "first",
}


def default_place(model_name: str) -> Literal["last", "first"]:
    """The ``place`` of a model: its :data:`PLACE_DEFAULTS` entry, else ``last``."""
    return PLACE_DEFAULTS.get(model_name, "last")


def with_place(options: AttentionSortOptions, model_name: str) -> AttentionSortOptions:
    """``options`` with ``place`` set: as given, or the model's :func:`default_place`."""
    if options.place is not None:
        return options
    return options.model_copy(update={"place": default_place(model_name)})
