"""Set-based prompting: a prompt's passages read as a set, order-invariant in one forward pass.

McIlroy-Young et al., "Set-Based Prompting: Provably Solving the Language Model Order Dependency
Problem" (arXiv 2406.06581, NeurIPS 2024), section 3: every passage of the set gets the same
position IDs ("parallel" positions) and attends only to the text before the set and to itself
(a block attention mask over the set members); the text after the set attends to every member.
No passage then sees another, and none is nearer the question than another, so the answer does
not depend on the order of the passages: it is the same for every permutation (up to floating
point), by construction.

The layout of a prompt (:func:`~ragfix.backends.passages.passage_set`): the chat-formatted text
before the first passage, each passage as rendered by its task (label included, ``Document
[i](Title: ...)``: the label travels with the passage) plus the task's separator, and the text
after the last passage, each tokenized on its own. Every passage ends with the separator, the
last one too: the text has one separator more than the ordered prompt
(``... passage\\n\\n\\nQuestion:`` for QA, a trailing comma in the KV object), so that no member
differs by where it stands.

Positions (``align``):

* ``start`` (the paper): every passage starts at the first position after the prefix,
  ``P .. P + L_i - 1``; the text after the set continues from ``P + max L_i``.
* ``end``: every passage ends where the last passage of the ordered prompt ends,
  ``E - L_i .. E - 1`` with ``E = P + sum L_i``: each reads as the one nearest the question; the
  text after the set keeps its ordered positions from ``E``.

A prompt without passage spans (a plain string, a framework's text) is refused in one line.
Decoding is greedy over the model's own KV cache (a 4-D additive mask in the prefill, then
generated tokens see everything before them). In a sliding-window layer (Mistral, Gemma 3's local
layers) a query also sees only the keys whose position IDs are less than ``window`` below its
own: the window is measured on the parallel positions, so it keeps the order invariance. No
prefix reuse: a cached prefix of another prompt was computed under another mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from ragfix.backends.base import BackendOptions
from ragfix.backends.family import full_cache, layer_masks
from ragfix.backends.passages import OUTSIDE, PAD, PassageSet, PassageSetBackend, padded_batch
from ragfix.backends.set_based.options import SetBasedOptions


def set_visibility(blocks: torch.Tensor) -> torch.Tensor:
    """Which keys each query of a left-padded batch sees in the prefill.

    Args:
        blocks: ``[B, T]`` per token its passage index, :data:`OUTSIDE` or :data:`PAD`.

    Returns:
        ``[B, T, T]`` bool: true where query ``i`` may attend key ``j`` (``j <= i``, ``j`` not
        padding, and ``j`` outside the passages, or ``i`` outside them, or both in the same
        passage); a padding query attends itself only. The model's sliding windows are applied
        on top (:func:`~ragfix.backends.family.layer_masks`).
    """
    t = blocks.shape[1]
    q, k = blocks[:, :, None], blocks[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=blocks.device).tril()
    seen = causal & (k != PAD) & ((q == OUTSIDE) | (k == OUTSIDE) | (q == k))
    return seen | (torch.eye(t, dtype=torch.bool, device=blocks.device) & (q == PAD))


class SetBasedBackend(PassageSetBackend):
    """The ``set-based`` backend: a task prompt's passages read as a set with parallel
    positions and a block mask (see the module docstring). Composes with an adapter.

    Args:
        model, tokenizer, adapter: as for :class:`~ragfix.backends.hf.HFBackend`.
        **options: :class:`SetBasedOptions`.
    """

    name: ClassVar[str] = "set-based"
    options_model: ClassVar[type[BackendOptions]] = SetBasedOptions

    @torch.no_grad()
    def _run(self, sets: Sequence[PassageSet], extra: Sequence[Sequence[int]] = ()):
        """See :meth:`PassageSetBackend._run`: one pass with the parallel positions of
        ``align`` and the block mask (:func:`set_visibility`), decoding over the model's KV
        cache."""
        batch = padded_batch(sets, extra, self.options.align, self.tokenizer.pad_token_id)
        dev, dtype = self.device, next(self.model.parameters()).dtype
        cache = full_cache()
        blocks, positions = batch.blocks.to(dev), batch.positions.to(dev)
        out = self.model(
            input_ids=batch.ids.to(dev),
            position_ids=positions,
            attention_mask=layer_masks(
                self.model,
                set_visibility(blocks),
                dtype,
                positions[:, :, None] - positions[:, None, :],
            ),
            cache=cache,
            logits_to_keep=1 + max((len(e) for e in extra), default=0),
        )
        # decoding: a new token sees every key but the padding (its row grows by one each step)
        state = {"positions": positions, "keys": blocks != PAD}

        @torch.no_grad()
        def step(nxt: torch.Tensor) -> torch.Tensor:
            at = state["positions"][:, -1:] + 1
            state["positions"] = torch.cat([state["positions"], at], dim=-1)
            new = torch.ones(len(sets), 1, dtype=torch.bool, device=dev)
            state["keys"] = torch.cat([state["keys"], new], dim=-1)
            return self.model(
                input_ids=nxt,
                position_ids=at,
                attention_mask=layer_masks(
                    self.model,
                    state["keys"][:, None],
                    dtype,
                    (at - state["positions"])[:, None],
                ),
                cache=cache,
            ).logits

        return out.logits, step


__all__ = ["SetBasedBackend", "set_visibility"]
