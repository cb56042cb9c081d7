"""Pruning before reordering: drop blank passages, drop near-duplicate passages, fit the rest
to a token budget.

All work on texts in retrieval order (index = rank, 0 = best) and return the indices to keep,
in the same order, so callers can apply them to nodes, passages or anything else. Each handles an
empty list (``[]``) and a single text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from ragfix.errors import ConfigError

_WORD = re.compile(r"\w+")


class BudgetError(ConfigError):
    """The best passage alone does not fit the token budget (it is never cut silently)."""


def shingles(text: str, size: int = 3) -> set[tuple[str, ...]]:
    """Word ``size``-grams of ``text`` (lower-cased); a text shorter than ``size`` words gives one
    shingle with all its words."""
    words = _WORD.findall(text.lower())
    if len(words) < size:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + size]) for i in range(len(words) - size + 1)}


def jaccard(a: set, b: set) -> float:
    """Jaccard similarity ``|a & b| / |a | b|`` (1.0 for two empty sets)."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def is_blank(text: str) -> bool:
    """True for a text with no word character (empty, white space or punctuation only): nothing
    a model could read an answer from."""
    return _WORD.search(text) is None


def drop_blank(texts: Sequence[str]) -> list[int]:
    """Indices of the texts that are not blank (:func:`is_blank`), in order."""
    return [i for i, t in enumerate(texts) if not is_blank(t)]


def drop_near_duplicates(texts: Sequence[str], threshold: float = 0.9) -> list[int]:
    """Indices of the texts to keep: a text whose word-3-gram Jaccard similarity with a
    higher-ranked kept text is ``>= threshold`` is dropped (the higher-ranked copy stays).
    A blank text has no word 3-grams and is never called a duplicate (drop blanks with
    :func:`drop_blank`).

    Args:
        texts: passages in retrieval order.
        threshold: similarity in ``(0, 1]`` at which two passages count as duplicates.
    """
    kept: list[int] = []
    kept_sh: list[set] = []
    for i, t in enumerate(texts):
        sh = shingles(t)
        if sh and any(jaccard(sh, k) >= threshold for k in kept_sh if k):
            continue
        kept.append(i)
        kept_sh.append(sh)
    return kept


def fit_budget(texts: Sequence[str], budget: int, count_tokens: Callable[[str], int]) -> list[int]:
    """Indices of the texts that fit ``budget`` tokens, dropping the lowest-ranked whole texts
    first (a text is never cut).

    Args:
        texts: passages in retrieval order.
        budget: tokens available for the passages (the model's window minus the template,
            question and answer budget).
        count_tokens: the backend's token counter (e.g. ``Backend.count_tokens``).

    Raises:
        BudgetError: the best passage alone needs more than ``budget`` tokens.
    """
    sizes = [count_tokens(t) for t in texts]
    if sizes and sizes[0] > budget:
        raise BudgetError(
            f"the best passage has {sizes[0]} tokens but only {budget} fit the model's context "
            "window; split the documents into smaller chunks or use a longer-context backend"
        )
    keep = list(range(len(texts)))
    total = sum(sizes)
    while total > budget:
        total -= sizes[keep.pop()]
    return keep
