"""Scoring for :class:`~ragfix.backends.hf.HFBackend` (:class:`HFScoring`): next-token
log-probabilities of a batch of prompts, the log-probability of each token of a text (with its
top alternatives), and log-likelihoods of continuations, over the backend's prefix-reuse KV cache
where it allows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragfix.backends.base import Prompt, TokenScores


class HFScoring:
    """The scoring job of :class:`~ragfix.backends.hf.HFBackend` (a base class of it, not a
    backend of its own): its methods read the backend's ``model``, ``device``, ``encode``,
    ``tokenize`` and prefix-reuse KV cache. :meth:`next_logprobs_ids` and
    :meth:`token_scores_ids` are extension points (see :class:`~ragfix.backends.hf.HFBackend`).
    All log-probabilities are computed from float32 logits."""

    @torch.no_grad()
    def next_logprobs_ids(self, batch: list[list[int]]) -> torch.Tensor:
        """Extension point: float32 ``[B, vocab]`` next-token log-probabilities on the CPU, one
        left-padded forward pass with position IDs counted from each prompt's first real
        token."""
        ids, mask = self._left_pad(batch)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
        return torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu()

    def next_token_logprobs(self, prompts: Sequence[Prompt], *, batch_size: int = 8):
        """See :meth:`Backend.next_token_logprobs`: float32 ``[B, vocab_size]`` on the CPU."""
        encoded = [self.encode(p) for p in prompts]
        size = batch_size if self.supports_batching else 1
        parts = [
            self.next_logprobs_ids(encoded[i : i + size]) for i in range(0, len(encoded), size)
        ]
        return torch.cat(parts)

    @torch.no_grad()
    def token_scores_ids(self, ids: list[int], top: int = 0) -> TokenScores:
        """Extension point: :class:`TokenScores` of ``ids`` (``n >= 2`` tokens: ``n - 1``
        scores) with ``top`` alternatives, one forward pass."""
        x = torch.tensor([ids], device=self.device)
        logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), dim=-1)
        return TokenScores.of(logp, x[0, 1:], top)

    def _tail_logprobs(self, ids: list[int], start: int) -> torch.Tensor:
        """Float32 ``[len(ids) - 1 - start, vocab]``: the next-token log-probabilities after
        ``ids[:t + 1]`` for ``t = start .. len(ids) - 2`` (row ``i`` scores ``ids[start + 1 + i]``),
        over the prefix-reuse KV cache cropped to what it shares with ``ids[:start]``; the cache
        then holds ``ids[:-1]``. Needs ``start < len(ids) - 1``."""
        common = self._crop_reuse_cache(ids[:start])
        logits = self.model(
            input_ids=torch.tensor([ids[common:-1]], device=self.device),
            position_ids=torch.arange(common, len(ids) - 1, device=self.device)[None],
            cache=self._reuse_cache,
            logits_to_keep=len(ids) - 1 - start,
        ).logits[0]
        self._reuse_ids = ids[:-1]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def loglikelihood(self, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
        """See :meth:`Backend.loglikelihood`. Where :attr:`supports_prefix_reuse`, each pair
        runs over the prefix-reuse KV cache (the one :meth:`generate` keeps), cropped to the
        tokens it shares with the pair before and at most to its context minus one token: pairs
        of one context, given together, prefill that context once and each continuation only
        (what scoring several candidate answers under one prompt costs). Equal to the
        one-pass sum up to floating-point differences of the shorter matmuls.

        Raises:
            ValueError: an empty continuation or context.
        """
        if not self.supports_prefix_reuse:
            return super().loglikelihood(pairs)
        out = []
        for context, continuation in pairs:
            ctx, cont = self.encode(context), self.tokenize(continuation)
            if not cont or not ctx:
                raise ValueError("loglikelihood needs a non-empty context and continuation")
            ids = ctx + cont
            logp = self._tail_logprobs(ids, len(ctx) - 1)
            target = torch.tensor(cont, device=logp.device)[:, None]
            out.append(float(logp.gather(1, target).sum()))
        return out

    def token_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """See :meth:`Backend.token_logprobs`: float32 ``[n - 1]`` on the CPU.

        Raises:
            ValueError: fewer than two tokens.
        """
        return self.token_scores(ids, 0).logprobs

    def token_scores(self, ids: Sequence[int], top: int) -> TokenScores:
        """See :meth:`Backend.token_scores` (the pass of :meth:`token_logprobs`). Where
        :attr:`supports_prefix_reuse`, consecutive calls share work (:meth:`_scores_reusing`:
        a scoring client of ``ragfix serve`` sends several continuations of one context).

        Raises:
            ValueError: fewer than two tokens.
        """
        if len(ids) < 2:
            raise ValueError("token_logprobs needs at least two tokens")
        if not self.supports_prefix_reuse:
            return self.token_scores_ids(list(ids), top)
        return self._scores_reusing(list(ids), top)

    @torch.no_grad()
    def _scores_reusing(self, ids: list[int], top: int) -> TokenScores:
        """:class:`TokenScores` of ``ids`` with the rows of the tokens it shares with the
        previous call's sequence (same ``top``) taken from that call (a row depends only on the
        tokens up to it), the others computed over the prefix-reuse KV cache (cropped to the
        prefix it shares with ``ids``); equal to one pass up to floating-point differences of
        the shorter matmuls."""
        before, scores = self._scored
        shared = 0
        if scores is not None and scores.top_ids.shape[1] == top:
            for a, b in zip(ids, before, strict=False):
                if a != b:
                    break
                shared += 1
        start = max(shared - 1, 0)  # the first row to compute (row t scores ids[t + 1])
        if start >= len(ids) - 1:
            return TokenScores(*(column[: len(ids) - 1] for column in scores))
        targets = torch.tensor(ids[start + 1 :], device=self.device)
        new = TokenScores.of(self._tail_logprobs(ids, start), targets, top)
        if start:
            new = TokenScores.cat([TokenScores(*(column[:start] for column in scores)), new])
        self._scored = (ids, new)
        return new
