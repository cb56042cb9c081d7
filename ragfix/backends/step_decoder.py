"""Continuous batching for :class:`~ragfix.backends.hf.HFBackend`: :class:`StepDecoder`, the
:class:`~ragfix.backends.base.Decoder` that ``ragfix serve`` steps, rows joining and leaving one
left-padded KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ragfix.backends.base import Backend, Cancel, Decoder, Prompt, answer_rules
from ragfix.backends.family import full_cache
from ragfix.types import Generation


@dataclass(eq=False)
class _Row:
    """A row of a :class:`StepDecoder`: its prompt's tokens, rules and answer so far."""

    ids: list[int]
    budget: int
    stop: bool
    first: torch.Tensor | None  # the first step's log-probabilities, when asked
    prefill: int  # tokens prefilled (after a reused prefix)
    start: float  # time.perf_counter() when it was added
    tokens: list[int]  # generated so far; the last one is not in the cache yet


class StepDecoder(Decoder):
    """Continuous batching over one left-padded KV cache (:class:`~ragfix.backends.base.Decoder`
    of an :class:`~ragfix.backends.hf.HFBackend` that
    :attr:`~ragfix.backends.hf.HFBackend.supports_step_decoding`: it reads that backend's model,
    tokenizer and prefix-reuse cache).

    :meth:`add` prefills the prompt alone (batch 1, all its tokens; with ``prefix_reuse`` over
    the backend's prefix-reuse cache, cropped to the prefix shared with the previous prompt),
    takes its greedy first token from the prefill's logits and inserts the row's keys and
    values into the batch cache, right aligned: when the row is longer than the cache, every
    other row is padded on the left. :meth:`step` runs one forward pass over every row's last
    token with the attention mask of the padding and each row's own position ids (its real
    tokens so far), so padding changes no row's positions or attention; rows that finish
    (the stop rule: EOS, a newline with ``stop_at_newline``; or their budget) leave the cache
    (:meth:`DynamicCache.batch_select_indices`), and the padding every remaining row shares is
    cut. Every layer keeps every key (:func:`~ragfix.backends.family.full_cache`); the model's
    masks hold a sliding layer to its window.

    Answers equal ``generate([prompt])``'s token for token on SmolLM2 in fp32
    (tests/test_decoder.py): the prefill is that call's (without prefix reuse its first-step
    log-probabilities are bitwise equal); a decoding step of ``B`` rows may round its matmuls
    otherwise than a step of one row, so later logits are equal up to floating-point rounding
    and a near-tie within it could flip a token. ``Generation.seconds`` is the row's time from
    :meth:`add` to its end.

    Memory: ``B x W`` tokens of keys and values in every layer (``W``: the longest row's prompt
    plus answer so far; SmolLM2-135M in fp32: 45 KiB a token), besides one prefill's cache.
    """

    continuous = True

    def __init__(self, backend: Backend, prefix_reuse: bool = False):
        super().__init__(backend, prefix_reuse)
        self.hf = backend
        self._rows: dict[int, _Row] = {}
        self._order: list[int] = []  # the rows in the cache, in batch order
        self._done: dict[int, Generation] = {}  # finished when added (first token stops)
        self._cache = None
        self._mask: torch.Tensor | None = None  # [B, W]: 1 on real tokens, 0 on left padding

    def __len__(self) -> int:
        return len(self._order) + len(self._done)

    @torch.no_grad()
    def add(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        stop_at_newline: bool | None = None,
        first_logprobs: bool = False,
        cancel: Cancel | None = None,
    ) -> int:
        """See :meth:`Decoder.add`: the prompt is read and prefilled here (``cancel`` is not
        asked: drop the row)."""
        hf, start = self.hf, time.perf_counter()
        ids = hf.encode(prompt)
        budget, stop = answer_rules(prompt, max_new_tokens, stop_at_newline)
        if self.prefix_reuse:
            common = hf._crop_reuse_cache(ids[:-1])
            cache = hf._reuse_cache
        else:
            common, cache = 0, full_cache()
        pos = torch.arange(common, len(ids), device=hf.device)[None]
        inp = torch.tensor([ids[common:]], device=hf.device)
        logits = hf.model(input_ids=inp, position_ids=pos, cache=cache, logits_to_keep=1).logits
        if self.prefix_reuse:
            hf._reuse_ids = ids
        last = logits[0, -1].float()
        tok = int(last.argmax())
        first = torch.log_softmax(last, dim=-1).cpu() if first_logprobs else None
        row_id = self._new_row()
        row = _Row(ids, budget, stop, first, len(ids) - common, start, [tok])
        self._rows[row_id] = row
        if budget <= 1 or hf._stops(tok, stop):
            self._done[row_id] = self._generation(row)
        else:
            self._insert(row_id, cache)
        return row_id

    def _insert(self, row_id: int, cache) -> None:
        """Append the row whose keys and values ``cache`` holds (batch 1) to the batch cache,
        right aligned (the shorter side padded on the left)."""
        n = cache.get_seq_length()
        width = 0 if self._mask is None else self._mask.shape[1]
        grow, pad = max(n - width, 0), max(width - n, 0)
        if self._cache is None:
            self._cache = full_cache()
        for i, layer in enumerate(cache.layers):
            k, v = layer.keys, layer.values
            if i >= len(self._cache.layers) or not self._cache.layers[i].is_initialized:
                self._cache.update(k.clone(), v.clone(), i)
                continue
            dest = self._cache.layers[i]
            dest.keys = torch.cat([_left(dest.keys, grow), _left(k, pad)])
            dest.values = torch.cat([_left(dest.values, grow), _left(v, pad)])
        row_mask = torch.ones(1, n, dtype=torch.long, device=self.hf.device)
        if self._mask is None:
            self._mask = row_mask
        else:
            self._mask = torch.cat([_left(self._mask, grow), _left(row_mask, pad)])
        self._order.append(row_id)

    def drop(self, row: int) -> None:
        """See :meth:`Decoder.drop`: the row leaves the cache now."""
        self._done.pop(row, None)
        if row in self._order:
            self._keep([r for r in self._order if r != row])
        self._rows.pop(row, None)

    def _keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in the cache's order) in the cache, and cut the left padding
        they all share."""
        if not rows:
            self._order, self._cache, self._mask = [], None, None
            return
        index = torch.tensor([self._order.index(r) for r in rows], device=self.hf.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        cut = self._mask.shape[1] - int(self._mask.sum(1).max())
        if cut > 0:
            self._mask = self._mask[:, cut:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
        self._order = rows

    def tokens(self, row: int) -> list[int]:
        """See :meth:`Decoder.tokens`."""
        return list(self._rows[row].tokens) if row in self._rows else []

    @torch.no_grad()
    def step(self) -> dict[int, Generation | Exception]:
        """See :meth:`Decoder.step`: one forward pass over every row in the cache (one token
        each); the rows finished when added come back too. A failed pass ends every row with
        its exception."""
        out: dict[int, Generation | Exception] = dict(self._done)
        self._done.clear()
        if not self._order:
            for r in out:
                self._rows.pop(r, None)
            return out
        rows = [self._rows[r] for r in self._order]
        dev = self.hf.device
        try:
            inp = torch.tensor([[r.tokens[-1]] for r in rows], device=dev)
            pos = torch.tensor([[len(r.ids) + len(r.tokens) - 1] for r in rows], device=dev)
            mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], dim=1)
            logits = self.hf.model(
                input_ids=inp, attention_mask=mask, position_ids=pos, cache=self._cache
            ).logits
        except Exception as e:
            for r in self._order:
                out[r] = e
                self._rows.pop(r, None)
            self._order, self._cache, self._mask = [], None, None
            return out
        self._mask = mask
        stay = []
        for r, row, tok in zip(self._order, rows, logits[:, -1].argmax(-1).tolist(), strict=True):
            row.tokens.append(tok)
            if len(row.tokens) >= row.budget or self.hf._stops(tok, row.stop):
                out[r] = self._generation(row)
            else:
                stay.append(r)
        if len(stay) < len(self._order):
            self._keep(stay)
        for r in out:
            self._rows.pop(r, None)
        return out

    def _generation(self, row: _Row) -> Generation:
        text, new, flags = self.hf._decode_answer(row.tokens, row.stop)
        return Generation(
            text=text,
            prompt_tokens=len(row.ids),
            new_tokens=len(new),
            token_ids=new,
            prefill_tokens=row.prefill,
            seconds=time.perf_counter() - row.start,
            first_logprobs=row.first,
            flags=list(flags),
            reasons=flags,
        )


def _left(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` (keys, values ``[B, H, T, D]`` or a mask ``[B, T]``) with ``n`` zero slots added
    on the left of its token axis."""
    if n == 0:
        return x
    axis = -2 if x.dim() == 4 else -1
    shape = list(x.shape)
    shape[axis] = n
    return torch.cat([x.new_zeros(shape), x], dim=axis)


__all__ = ["StepDecoder"]
