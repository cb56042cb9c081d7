"""The ``truncated`` backend: the unmodified model held to a window of ``train_window`` tokens.

The baseline a context-extension method is measured against: a prompt that does not fit (with its
answer budget) is cut in the middle, keeping its first and last halves, as LongBench does for
models whose window is shorter than the input (Bai et al., arXiv 2308.14508, section 3) and as
GALI's evaluation inherits (arXiv 2502.02659). The instruction at the start and the question at
the end survive; passages in the middle are dropped.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ragfix.backends.base import BackendOptions
from ragfix.backends.hf import HFBackend
from ragfix.errors import ConfigError
from ragfix.types import Generation


class TruncatedOptions(BackendOptions):
    """Options of the ``truncated`` backend.

    Attributes:
        train_window: the window in tokens (prompt plus answer; default: the model's
            ``max_position_embeddings``).
    """

    train_window: int | None = Field(None, ge=2)


def truncate_middle(ids: list[int], budget: int) -> list[int]:
    """``ids`` cut to ``budget`` tokens by dropping the middle (first ``budget // 2`` and last
    ``budget - budget // 2`` tokens kept); unchanged when it fits.

    Raises:
        ValueError: ``budget < 1``.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    if len(ids) <= budget:
        return list(ids)
    head = budget // 2
    return list(ids[:head]) + list(ids[len(ids) - (budget - head) :])


class TruncatedBackend(HFBackend):
    """The model with prompts middle-truncated to ``train_window - max_new_tokens`` tokens.

    Answers, first-step log-probabilities and next-token log-probabilities all come from the
    cut prompt, so a judge's verdict text and its letter probabilities read the same input.
    """

    name = "truncated"
    options_model = TruncatedOptions
    supports_prefix_reuse = False  # the cut depends on the whole prompt
    cuts_long_prompts = True  # the method: long prompts are cut to the window

    @property
    def context_window(self) -> int:
        """``train_window`` (default: the model's trained window)."""
        return self.options.train_window or int(self.model.config.max_position_embeddings)

    def _budget(self, reserved: int) -> int:
        budget = self.context_window - reserved
        if budget < 1:
            raise ConfigError(
                f"an answer budget of {reserved} tokens leaves no room in the {self.context_window}"
                "-token window"
            )
        return budget

    def _generate_ids(
        self,
        batch: list[list[int]],
        max_new_tokens: int,
        stop_at_newline: bool,
        first_logprobs: bool = False,
    ) -> list[Generation]:
        """Greedy decoding of the middle-truncated prompts; ``prompt_tokens`` is the original
        length, ``prefill_tokens`` the length actually read.

        Raises:
            ConfigError: ``max_new_tokens`` leaves no room in the window.
        """
        budget = self._budget(max_new_tokens)
        cut = [truncate_middle(ids, budget) for ids in batch]
        gens = super()._generate_ids(cut, max_new_tokens, stop_at_newline, first_logprobs)
        return [
            g.model_copy(update={"prompt_tokens": len(ids), "prefill_tokens": len(c)})
            for g, ids, c in zip(gens, batch, cut, strict=True)
        ]

    def _next_logprobs_ids(self, batch: list[list[int]]) -> torch.Tensor:
        """Next-token log-probabilities after the prompts cut to ``train_window - 1`` tokens."""
        budget = self._budget(1)
        return super()._next_logprobs_ids([truncate_middle(ids, budget) for ids in batch])
