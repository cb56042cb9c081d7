"""Reorder strategies: where each retrieved passage goes in the prompt.

Every strategy maps retrieval ranks to prompt positions. Ranks and positions are 0-based here
(rank 0 = the retriever's best passage, position 0 = the first document of the prompt); the
functions return ``order``, a permutation of ``range(n)`` where ``order[j]`` is the rank of the
passage placed at prompt position ``j``.

* ``none``: the retriever's order.
* ``lost-in-the-middle``: the best passages at the two ends of the context, the weakest in the
  middle (Liu et al., "Lost in the Middle", TACL 2024, Fig. 1; the placement of LlamaIndex's
  ``LongContextReorder``), but stable: rank 0 is first whatever the count.
* ``reverse``: the best passage last, next to the question.
* ``bias-profile``: measured, not assumed. Given a position curve of this model (accuracy per
  prompt position from ``ragfix eval``), rank ``r`` goes to the ``r``-th most accurate position.
* ``attention-sort``: the model reads the task's prompt (:mod:`ragfix.tasks`) once; the passages
  are sorted by the attention the text after them (the question) pays them, ascending, so the
  most attended passage ends up last, next to the question (Peysakhovich & Lerer, arXiv
  2310.01427, Sec. 3); the scores of the upper half of the layers by default. The same scorer as
  the ``attention-sort`` backend (:mod:`ragfix.backends.attention_sort`).
* ``attention-sort-calibrated``: the same, minus the attention the content-free query ``N/A``
  pays the same passages (in-context re-ranking, Chen et al., arXiv 2410.02642, Sec. 3.2).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ragfix.errors import ConfigError
from ragfix.tasks import get_task
from ragfix.types import Passage

if TYPE_CHECKING:
    from ragfix.backends.base import Backend

STRATEGIES = (
    "none",
    "lost-in-the-middle",
    "reverse",
    "bias-profile",
    "attention-sort",
    "attention-sort-calibrated",
)
#: the strategies that read the passages with a model
ATTENTION_STRATEGIES = ("attention-sort", "attention-sort-calibrated")


class ProfileError(ConfigError):
    """A bias profile that cannot be used (wrong model, wrong number of documents, bad file)."""


def check_strategy(name: str) -> str:
    """``name`` if it is a known strategy.

    Raises:
        ConfigError: unknown strategy (the message lists the known ones).
    """
    if name not in STRATEGIES:
        raise ConfigError(
            f"unknown reorder strategy {name!r}; choose one of: {', '.join(STRATEGIES)}"
        )
    return name


def none_order(n: int) -> list[int]:
    """The retriever's order: ``[0, 1, ..., n-1]``."""
    return list(range(n))


def reverse_order(n: int) -> list[int]:
    """Best passage last: ``[n-1, ..., 1, 0]``."""
    return list(range(n - 1, -1, -1))


def lost_in_the_middle_order(n: int) -> list[int]:
    """Best at the ends, weakest in the middle; rank 0 always first.

    Even ranks fill the context from the front, odd ranks from the back: for ``n = 5`` the order
    is ``[0, 2, 4, 3, 1]``, for ``n = 6`` it is ``[0, 2, 4, 5, 3, 1]``.
    """
    front = list(range(0, n, 2))
    back = list(range(1, n, 2))
    return front + back[::-1]


def bias_profile_order(accuracies: Sequence[float]) -> list[int]:
    """Rank ``r`` goes to the ``r``-th most accurate position of the profile.

    Args:
        accuracies: accuracy per prompt position (length ``n``, position 0 first). Ties keep the
            earlier position first.

    Returns:
        ``order`` of length ``n`` (``order[position] = rank``).
    """
    by_accuracy = sorted(range(len(accuracies)), key=lambda p: (-accuracies[p], p))
    order = [0] * len(accuracies)
    for rank, pos in enumerate(by_accuracy):
        order[pos] = rank
    return order


def load_profile(
    source: str | Path | Sequence[float],
    model: str | None = None,
    num_docs: int | None = None,
    curve: str | None = None,
) -> list[float]:
    """Accuracy per prompt position, from a sweep's ``summary.json`` or given directly.

    Args:
        source: path of a ``summary.json`` written by ``ragfix eval`` (raw-model sweep, x-axis
            prompt position; or a pipeline sweep, whose ``none`` curve is used), or a list of
            accuracies (position 0 first).
        model: the model the profile must belong to (checked against the summary's ``model``).
        num_docs: the number of documents it must cover.
        curve: the curve label to use when the summary holds several (default: the only one, else
            the backend's curve without a strategy).

    Raises:
        ProfileError: unreadable file, another model, another number of documents, missing
            positions, or an ambiguous curve.
    """
    if not isinstance(source, (str, Path)):
        acc = [float(a) for a in source]
        where = "the given profile"
    else:
        path = Path(source)
        try:
            summary = json.loads(path.read_text())
            curves = summary["curves"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProfileError(f"{path}: not a ragfix summary.json ({e})") from None
        if model is not None and summary.get("model") not in (None, model):
            raise ProfileError(
                f"{path}: profile of model {summary.get('model')!r}, not {model!r}; "
                f"run `ragfix eval ... --model {model}` to measure this model's profile"
            )
        if num_docs is not None and summary.get("num_docs") != num_docs:
            raise ProfileError(
                f"{path}: profile for {summary.get('num_docs')} documents, not {num_docs}; "
                f"measure it with `ragfix eval ... --num-docs {num_docs}`"
            )
        plain = [k for k in curves if "/" not in k]
        if curve is None:
            if len(curves) == 1:
                curve = next(iter(curves))
            elif len(plain) == 1:
                curve = plain[0]
            else:
                raise ProfileError(f"{path}: several curves ({', '.join(curves)}); name one")
        if curve not in curves:
            raise ProfileError(f"{path}: no curve {curve!r} (has {', '.join(curves)})")
        stats = {int(p["position"]): float(p["accuracy"]) for p in curves[curve]["positions"]}
        n = num_docs or summary.get("num_docs") or len(stats)
        missing = [p for p in range(n) if p not in stats]
        if missing:
            raise ProfileError(f"{path}: curve {curve!r} lacks positions {missing}")
        acc = [stats[p] for p in range(n)]
        where = f"{path}"
    if num_docs is not None and len(acc) != num_docs:
        raise ProfileError(f"{where}: {len(acc)} positions, not {num_docs}")
    if not acc:
        raise ProfileError(f"{where}: empty profile")
    return acc


def static_order(strategy: str, n: int, profile: Sequence[float] | None = None) -> list[int]:
    """The order of a content-blind strategy for ``n`` passages (``[]`` for none, ``[0]`` for
    one, whatever the strategy and profile: there is nothing to place).

    Raises:
        ConfigError: unknown strategy, an attention strategy (needs a model), ``bias-profile``
            without a profile.
        ProfileError: a profile of another length (``n >= 2``).
    """
    check_strategy(strategy)
    if n <= 1 and strategy not in ATTENTION_STRATEGIES:
        return none_order(n)
    if strategy == "none":
        return none_order(n)
    if strategy == "reverse":
        return reverse_order(n)
    if strategy == "lost-in-the-middle":
        return lost_in_the_middle_order(n)
    if strategy == "bias-profile":
        if profile is None:
            raise ConfigError("bias-profile needs a profile (summary.json or accuracies)")
        if len(profile) != n:
            raise ProfileError(
                f"bias profile covers {len(profile)} documents but {n} passages were given; "
                f"measure a profile with {n} documents"
            )
        return bias_profile_order(profile)
    raise ConfigError(f"{strategy} reads the passages with a model: use attention_sort_order")


def attention_sort_order(
    backend: Backend,
    question: str,
    passages: Sequence[Passage],
    rounds: int = 1,
    task: str = "qa",
    layers: str = "upper",
    calibrate: bool = False,
) -> tuple[list[int], list[list[float]]]:
    """Attention sorting of ``passages`` in ``task``'s prompt for ``question``
    (:func:`ragfix.backends.attention_sort.sort_passages`: the attention of the text after the
    passages, ``layers`` ``upper`` or ``all``, minus the content-free query's with
    ``calibrate``; ascending, stable, so the most attended passage is last).

    Args:
        backend: the backend that reads the prompt (a local model).
        question: the question.
        passages: the passages in retrieval order (index = rank).
        rounds: sorting rounds (>= 1).
        task: the task whose prompt is read (a :mod:`ragfix.tasks` name).
        layers, calibrate: see :class:`~ragfix.backends.attention_sort.AttentionSortOptions`.

    Returns:
        ``(order, attention)``: ``order[position] = rank``; ``attention`` holds each round's
        score per rank (``rounds`` lists of ``n`` floats; no rounds, and no model call, for
        fewer than two passages).

    Raises:
        ConfigError: ``rounds < 1``, an empty question (the passages are never sorted by the
            attention of an empty ``Question:``), an unknown ``layers`` or task.
        RagfixError: the backend exposes no attention weights (a remote model).
    """
    from ragfix.backends.attention_sort import AttentionSortOptions, sort_passages

    if rounds < 1:
        raise ConfigError("attention-sort needs at least one round")
    if not question or not question.strip():
        raise ConfigError(
            "attention-sort needs the query: it sorts the passages by the attention the question "
            "pays them (pass query_str= or query_bundle= to postprocess_nodes)"
        )
    if layers not in ("upper", "all"):
        raise ConfigError(f"attention-sort layers must be 'upper' or 'all', not {layers!r}")
    if len(passages) < 2:
        return none_order(len(passages)), []
    options = AttentionSortOptions(rounds=rounds, layers=layers, calibrate=calibrate)
    return sort_passages(backend, get_task(task).prompt(question, passages), options)
