"""The base of the methods that read each prompt through their own layout and run their own
forward pass (``set-based``, ``pine``, ``calibrated-attention``): :class:`LayoutBackend`, an
:class:`~ragfix.backends.hf.HFBackend` whose extension points are :meth:`LayoutBackend._layout`
and :meth:`LayoutBackend._run`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ragfix.backends.base import Cancel, Prompt, answer_rules, check_cancel
from ragfix.backends.decoding import batch_groups, greedy_steps
from ragfix.backends.hf import HFBackend
from ragfix.types import Generation


class LayoutBackend(HFBackend):
    """A backend that reads each prompt through its own layout and runs its own forward pass
    over a batch of layouts: the base of the methods whose attention is not the model's over
    the prompt's plain tokens (``set-based``, ``pine``, ``calibrated-attention``). It fills
    greedy :meth:`generate`, :meth:`next_token_logprobs`, :meth:`loglikelihood` and
    :meth:`stream` from two hooks: :meth:`_layout` (a prompt -> an object with ``.ids``, the
    tokens the model reads; it refuses what the method cannot read) and :meth:`_run` (one
    forward pass over a batch of layouts, and its cached decoding step). No prefix reuse (a
    cached prefix of another prompt was computed under another layout).
    """

    supports_prefix_reuse = False
    supports_step_decoding = False

    def _layout(self, prompt: Prompt):
        """The layout of ``prompt`` that :meth:`_run` reads (it has ``.ids``: the tokens the
        model reads, in prompt order).

        Raises:
            RagfixError: a prompt the method cannot read.
        """
        raise NotImplementedError

    def encode(self, prompt: Prompt) -> list[int]:
        """The tokens the model reads for ``prompt`` (its :meth:`_layout`'s ``ids``).

        Raises:
            RagfixError: a prompt the method cannot read.
        """
        return self._layout(prompt).ids

    def _run(self, layouts: Sequence, extra: Sequence[Sequence[int]] = ()):
        """One forward pass over a left-padded batch of ``layouts`` (each followed by its
        ``extra`` tokens, which attend to everything before them, like the text after the
        passages).

        Returns:
            ``(logits, step)``: ``[B, n, vocab]`` logits of the pass's last ``n`` positions
            (``n`` at least one more than the longest ``extra``; all of them where the method
            computes them anyway), and the cached decoding step (``[B, 1]`` next token ids ->
            ``[B, 1, vocab]`` logits).
        """
        raise NotImplementedError

    def _greedy(
        self,
        layouts: Sequence,
        max_new_tokens: int,
        stop_at_newline: bool,
        cancel: Cancel | None = None,
    ):
        """Greedy decoding of ``layouts`` in one batch: the steps of :func:`greedy_steps` over
        :meth:`_run` (``cancel`` ends them between steps)."""
        logits, step = self._run(layouts)
        return greedy_steps(
            logits[:, -1:], step, max_new_tokens, lambda t: self._stops(t, stop_at_newline), cancel
        )

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        batch_size: int = 8,
        max_new_tokens: int | None = None,
        stop_at_newline: bool | None = None,
        first_logprobs: bool = False,
        prefix_reuse: bool = False,
        cancel: Cancel | None = None,
    ) -> list[Generation]:
        """Greedy answers (see :meth:`~ragfix.backends.base.Backend.generate`), prompts of
        similar length and the same budget and stop rule batched; ``prefix_reuse`` is ignored.

        Raises:
            RagfixError: a prompt the method cannot read.
            Cancelled: ``cancel`` was set before every answer was complete.
        """
        items = [
            (self._layout(p), *answer_rules(p, max_new_tokens, stop_at_newline)) for p in prompts
        ]
        order = sorted(range(len(items)), key=lambda i: len(items[i][0].ids))
        results: list[Generation | None] = [None] * len(items)
        for group in batch_groups(items, order, batch_size):
            mnt, stop = items[group[0]][1:]
            layouts = [items[j][0] for j in group]
            gens = self._collect(
                self._greedy(layouts, mnt, stop, cancel),
                [len(s.ids) for s in layouts],
                stop,
                first_logprobs,
            )
            check_cancel(cancel)
            for j, g in zip(group, gens, strict=True):
                results[j] = g
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def next_token_logprobs(self, prompts: Sequence[Prompt], *, batch_size: int = 8):
        """See :meth:`~ragfix.backends.base.Backend.next_token_logprobs`: float32
        ``[B, vocab_size]`` on the CPU, each prompt read through its layout.

        Raises:
            RagfixError: a prompt the method cannot read.
        """
        layouts = [self._layout(p) for p in prompts]
        parts = []
        for i in range(0, len(layouts), batch_size):
            logits, _ = self._run(layouts[i : i + batch_size])
            parts.append(torch.log_softmax(logits[:, -1].float(), dim=-1).cpu())
        return torch.cat(parts)

    @torch.no_grad()
    def loglikelihood(self, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
        """Summed log-probability (nats) of each continuation after its context read through
        its layout (the continuation's tokens attend to everything before them).

        Raises:
            RagfixError: a context the method cannot read.
            ValueError: an empty continuation.
        """
        out = []
        for context, continuation in pairs:
            s, cont = self._layout(context), self.tokenize(continuation)
            if not cont:
                raise ValueError("loglikelihood needs a non-empty continuation")
            logits, _ = self._run([s], [cont])
            logp = torch.log_softmax(logits[0, -len(cont) - 1 : -1].float(), dim=-1)
            target = torch.tensor(cont, device=logp.device)[:, None]
            out.append(float(logp.gather(1, target).sum()))
        return out

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 256,
        stop_at_newline: bool = False,
        cancel: Cancel | None = None,
    ) -> Iterator[str]:
        """Yield the greedy answer to one prompt piece by piece; closing the iterator or
        ``cancel`` stops decoding at once.

        Raises:
            RagfixError: a prompt the method cannot read.
            Cancelled: ``cancel`` was set before the answer was complete.
        """
        with torch.no_grad():  # the prefill runs here
            steps = self._greedy([self._layout(prompt)], max_new_tokens, stop_at_newline, cancel)
        yield from self._stream_steps(steps)
        check_cancel(cancel)


__all__ = ["LayoutBackend"]
