"""The ``truncated`` backend: the unmodified model held to a window of ``train_window`` tokens.

The baseline a context-extension method is measured against: a prompt that does not fit (with its
answer budget) is cut in the middle, keeping its first and last halves, as LongBench does for
models whose window is shorter than the input (Bai et al., arXiv 2308.14508, section 3) and as
GALI's evaluation inherits (arXiv 2502.02659). The instruction at the start and the question at
the end survive; passages in the middle are dropped.

Scoring a text (:meth:`TruncatedBackend.token_logprobs`, perplexity) holds the model to the same
window by strided sliding windows: every forward pass reads at most ``train_window`` tokens and
scores its last ``score_stride`` tokens, so each token is predicted from between
``train_window - score_stride`` and ``train_window - 1`` tokens before it (the sliding-window
evaluation of Press et al., "Train Short, Test Long", arXiv 2108.12409; the "strided" perplexity
of the transformers documentation). ``score_stride = 1`` gives every token its full window at one
forward pass per token; cutting the middle of every token's context would cost as much. A banded
attention mask over one pass is not the same thing: in a multi-layer model the hidden states of
the visible keys carry information from further back.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ragfix.backends.base import Cancel, TokenScores
from ragfix.backends.hf import HFBackend
from ragfix.backends.truncated.options import TruncatedOptions
from ragfix.errors import ConfigError
from ragfix.types import Generation


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
    :meth:`token_logprobs` (and so ``loglikelihood``) reads a long text in strided sliding
    windows of ``train_window`` tokens.

    Raises (constructor):
        ConfigError: ``score_stride >= train_window``.
    """

    name = "truncated"
    options_model = TruncatedOptions
    supports_prefix_reuse = False  # the cut depends on the whole prompt
    supports_step_decoding = False  # it reads the cut prompt (generate_ids)
    cuts_long_prompts = True  # the method: long prompts are cut to the window

    def __init__(self, model, tokenizer, *, adapter: dict | None = None, **options):
        super().__init__(model, tokenizer, adapter=adapter, **options)
        #: targets scored per sliding window beyond the window (see :meth:`token_scores_ids`)
        self.score_stride = self.options.score_stride or max(1, self.context_window // 4)
        if self.score_stride >= self.context_window:
            raise ConfigError(
                f"score_stride {self.score_stride} must be < train_window {self.context_window}"
            )

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

    def generate_ids(
        self,
        batch: list[list[int]],
        max_new_tokens: int,
        stop_at_newline: bool,
        first_logprobs: bool = False,
        cancel: Cancel | None = None,
    ) -> list[Generation]:
        """Greedy decoding of the middle-truncated prompts; ``prompt_tokens`` is the original
        length, ``prefill_tokens`` the length actually read (``cancel``: see
        :meth:`HFBackend.generate_ids`).

        Raises:
            ConfigError: ``max_new_tokens`` leaves no room in the window.
        """
        budget = self._budget(max_new_tokens)
        cut = [truncate_middle(ids, budget) for ids in batch]
        gens = super().generate_ids(cut, max_new_tokens, stop_at_newline, first_logprobs, cancel)
        return [
            g.model_copy(update={"prompt_tokens": len(ids), "prefill_tokens": len(c)})
            for g, ids, c in zip(gens, batch, cut, strict=True)
        ]

    @torch.no_grad()
    def token_scores_ids(self, ids: list[int], top: int = 0) -> TokenScores:
        """:class:`TokenScores` of ``log p(ids[t] | context)`` for ``t = 1..n-1`` (with ``top``
        alternatives from the same distributions), reading at most
        ``L`` = :attr:`context_window` tokens (context plus the token) per forward pass.

        Strided sliding windows (module docstring): the first ``L`` tokens are scored as one
        sequence; then each window ``ids[b - L : b]`` scores its last ``s`` targets ``b - s ..
        b - 1`` (``s`` = ``score_stride``, the last window fewer), so a target beyond ``L`` has
        between ``L - s`` and ``L - 1`` tokens of context. ``1 + ceil((n - L) / s)`` passes of
        ``L`` tokens; within the window it is the plain model.
        """
        big_l = self.context_window
        stride = self.score_stride
        parts = [super().token_scores_ids(ids[:big_l], top)]
        for a in range(big_l, len(ids), stride):
            b = min(a + stride, len(ids))
            x = torch.tensor([ids[b - big_l : b]], device=self.device)
            logits = self.model(input_ids=x, logits_to_keep=b - a + 1).logits[0, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            parts.append(TokenScores.of(logp, x[0, big_l - (b - a) :], top))
        return TokenScores.cat(parts)

    def stream_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_at_newline: bool,
        cancel: Cancel | None = None,
    ) -> Iterator[str]:
        """The answer to the middle-truncated prompt, piece by piece (as :meth:`generate_ids`
        reads it).

        Raises:
            ConfigError: ``max_new_tokens`` leaves no room in the window.
            Cancelled: ``cancel`` was set before the answer was complete.
        """
        cut = truncate_middle(prompt_ids, self._budget(max_new_tokens))
        yield from super().stream_ids(cut, max_new_tokens, stop_at_newline, cancel)

    def next_logprobs_ids(self, batch: list[list[int]]) -> torch.Tensor:
        """Next-token log-probabilities after the prompts cut to ``train_window - 1`` tokens."""
        budget = self._budget(1)
        return super().next_logprobs_ids([truncate_middle(ids, budget) for ids in batch])
