"""The options of the ``gali`` backend and its default and paper chunk size and local window."""

from __future__ import annotations

from pydantic import Field

from ragfix.backends.base import BackendOptions

#: the paper's setting (Llama-3-8B, L = 8192): chunk 3000, local window 128 (the benchmark's
#: reference, scaled linearly to other windows by :func:`paper_setting`)
PAPER_WINDOW, PAPER_CHUNK, PAPER_LOCAL_WINDOW = 8192, 3000, 128
#: the default chunk size as a fraction of ``L`` (the local window defaults to the chunk size):
#: the lowest perplexity at 4 L on the tune windows at L = 256, 512 and 1024 (docs/gali.md)
DEFAULT_CHUNK_FRACTION = 1 / 8


def default_chunk_size(train_window: int) -> int:
    """The default chunk size ``s`` for ``L = train_window``: ``L * DEFAULT_CHUNK_FRACTION``,
    at least 1 (the default local window is ``s`` too)."""
    return max(1, round(train_window * DEFAULT_CHUNK_FRACTION))


def paper_setting(train_window: int) -> dict[str, int]:
    """The paper's chunk size and local window scaled to ``L = train_window``
    (``3000 L / 8192`` and ``128 L / 8192``, at least 1)."""
    return {
        "chunk_size": max(1, PAPER_CHUNK * train_window // PAPER_WINDOW),
        "local_window": max(1, PAPER_LOCAL_WINDOW * train_window // PAPER_WINDOW),
    }


class GaliOptions(BackendOptions):
    """Options of the ``gali`` backend (defaults tuned on the embedded model, scaled to the window).

    Attributes:
        train_window: ``L``, the trained window (default: the model's ``max_position_embeddings``);
            lower it to exercise the method on short prompts (e.g. 512 on SmolLM2).
        target_window: the extended window reported as ``context_window`` (default ``4 * L``, the
            paper's largest tested ratio, 8k -> 32k).
        chunk_size: prefill chunk size ``s`` after the first chunk (default
            :func:`default_chunk_size`: ``L / 8``, tuned on perplexity at 4 L; the paper's
            ``3000 L / 8192`` is :func:`paper_setting`).
        local_window: ``W``, the minimum number of recent tokens with integer positions
            (default: the chunk size, at most ``L - 1``). With ``s <= W`` every query of a
            chunk sits in the integer tail of the positions (the tail is never shorter than
            ``W``), so no query is at an interpolated position.
        noise: add the paper's Gaussian noise to interpolated logits.
        noise_std: ``std_base``, the noise standard deviation at token distance ``T``.
        seed: seed of the noise generator, reset for every batch; every row of a batch gets the
            noise it would get alone.
        query_block: query rows per attention block (``None``: the whole chunk at once).
    """

    train_window: int | None = Field(None, ge=2)
    target_window: int | None = Field(None, ge=2)
    chunk_size: int | None = Field(None, ge=1)
    local_window: int | None = Field(None, ge=0)
    noise: bool = True
    noise_std: float = Field(1.0, ge=0)
    seed: int = 0
    query_block: int | None = Field(256, ge=1)
