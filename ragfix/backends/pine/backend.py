"""PINE: order-invariant reading of a prompt's passages, positions re-assigned by importance.

Wang et al., "Eliminating Position Bias of Language Models: A Mechanistic Approach" (arXiv
2407.01100, ICLR 2025), section 3; the math of the official code (wzq016/PINE,
``pine/models/llama/modeling_llama.py``, ``LlamaAttentionWithPS.forward``). The prompt is laid
out as a passage set (:func:`~ragfix.backends.passages.passage_set`: the text before the
passages, each passage with its label and separator, the text after) and every attention layer
computes, from pre-RoPE queries and keys:

* **base positions** (the official tokenizer's ``all_position_ids``): the prefix at
  ``0 .. P - 1``; every passage right-aligned to end at ``E - 1``, ``E = P + sum L_i``; the text
  after the passages (and every generated token) from ``E`` on;
* **passage queries** (passage ``d``): bidirectional attention between passages, causal inside
  each. The other passages are ordered by their importance to ``d`` (per head: the softmax of
  ``q k^T * scaling`` without RoPE from ``d``'s tokens over the tokens of the *other* passages,
  summed per passage and divided by its length, summed over ``d``'s tokens) and placed before
  ``d``, the most important nearest: passage ``j`` ranked ``r`` is shifted back by the lengths
  of ``d`` and the passages ranked before it. A key is seen when its (shifted) position is at
  most the query's;
* **queries after the passages** (the question, the assistant turn, each generated token): per
  head and per query, the passages ordered by the query's attention without RoPE (softmax over
  all passage tokens, summed per passage, divided by its length), the most important right
  before the question (shift 0), the next before it, and so on; causal by sequence order;
* **prefix queries**: ordinary causal attention.

Each query sees the keys at the positions it gives them (per head and query), so the keys and
values are cached before RoPE and every decoding step re-ranks the passages; the scores are
computed with each query rotated once per passage (RoPE is a rotation by position, so shifting a
key back by ``s`` is rotating the query forward by ``s``): one score per (query, key), as in
vanilla attention, plus a rotation of each query per passage. Invariant to the order of the
passages by construction (up to floating point and ties in importance).

Like the official code, attention is computed explicitly in this module (any
``attn_implementation``), one prompt of a batch at a time inside each layer (the MLPs and
projections run batched). Every family reaches it through :mod:`ragfix.backends.family`: the
module's own projections and q/k norms, each layer's RoPE table (Gemma 3's local and global
bases), its ``scaling``; in a sliding-window layer a query sees, on top of PINE's rule, only the
keys less than ``window`` positions from its own at the positions it gives them (re-assigned by
importance: the order invariance holds; the official code has no sliding windows). Refuses, in
one line: a family whose RoPE rotates only part of each head or whose attention logits are
soft-capped (before any weights are loaded), prompts without passage spans, and a model whose
attention another method already patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from ragfix.backends.base import BackendOptions
from ragfix.backends.family import (
    Family,
    layer_window,
    project_qkv,
    rotary_tables,
    window_band,
)
from ragfix.backends.passages import (
    OUTSIDE,
    PAD,
    PassageSet,
    PassageSetBackend,
    padded_batch,
)
from ragfix.backends.patching import attention_modules, routed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def passage_shifts(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """How far back each passage moves when ranked by ``scores`` (the official code's
    ``position_shift``).

    Args:
        scores: ``[..., n]`` importance of each of ``n`` passages (higher = nearer).
        lengths: ``[n]`` passage lengths (tokens).

    Returns:
        ``[..., n]`` int64: passage ``j``'s shift is the summed length of the passages ranked
        before it (stable descending sort: ties keep passage order); the top one gets 0.
    """
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    ranked = lengths[order]
    before = torch.cumsum(ranked, dim=-1) - ranked
    return torch.gather(before, -1, torch.argsort(order, dim=-1))


class _PineRun:
    """State of one prefill/decode run over a left-padded batch of passage sets: per row the
    base positions and blocks of its tokens, per layer the keys (before RoPE and at their base
    positions) and values of every query head, and the RoPE tables."""

    def __init__(self, backend: PineBackend, sets: Sequence[PassageSet], extra=()):
        batch = padded_batch(sets, extra, "end", backend.tokenizer.pad_token_id)
        self.ids = batch.ids.to(backend.device)
        self.base = batch.positions.to(backend.device)  # [B, T]
        self.blocks = batch.blocks.to(backend.device)  # [B, T]
        self.lengths = [
            torch.tensor([len(p) for p in s.passages], device=backend.device) for s in sets
        ]
        #: per layer, per query head: keys before RoPE, keys at base positions, values
        self.heads: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.start = 0  # index of the step's first query
        self.model = backend.model
        self.device = backend.device
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def grow(self, c: int) -> None:
        """Add ``c`` generated tokens: outside the passages, positions after each row's last."""
        b = self.base.shape[0]
        last = self.base[:, -1:]
        steps = torch.arange(1, c + 1, device=self.device)[None]
        self.base = torch.cat([self.base, last + steps], dim=1)
        more = torch.full((b, c), OUTSIDE, device=self.device, dtype=self.blocks.dtype)
        self.blocks = torch.cat([self.blocks, more], dim=1)

    def tables(self, dtype, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[N, d]`` of layer ``layer``'s rotary embedding, up to the largest base
        position plus the passages' summed length (a query rotated forward by a shift)."""
        top = int(self.base.max()) + 1 + max(int(x.sum()) for x in self.lengths)
        have = self._tables.get(layer)
        if have is None or have[0].shape[0] < top or have[0].dtype != dtype:
            self._tables[layer] = rotary_tables(self.model, layer, top, dtype, self.device)
        return self._tables[layer]

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """PINE attention of the step's queries over every cached key.

        Args:
            attn: the layer's attention module (``scaling``, ``layer_idx``).
            q: pre-RoPE queries ``[B, H, c, d]``; k, v: the step's pre-RoPE keys / values
                ``[B, Hkv, c, d]``, appended to the layer's cache.

        Returns:
            ``[B, c, H * d]`` attention output (before ``o_proj``).
        """
        bsz, heads, c, d = q.shape
        groups = heads // k.shape[1]
        out = torch.zeros(bsz, heads, c, d, device=q.device, dtype=q.dtype)
        cos, sin = self.tables(q.dtype, attn.layer_idx)
        window = layer_window(attn)
        # the step's new keys and values, per query head, and the keys at their base positions
        # (which never change): appended to this layer's cache of them
        new_k = k.repeat_interleave(groups, dim=1)  # [B, H, c, d]
        new_v = v.repeat_interleave(groups, dim=1)
        cached = self.heads[attn.layer_idx][0].shape[2] if attn.layer_idx in self.heads else 0
        at = self.base[:, cached : cached + c]  # [B, c]
        new_rot = _rope(new_k, cos[at][:, None], sin[at][:, None])
        parts = (new_k, new_rot, new_v)
        if attn.layer_idx in self.heads:
            parts = tuple(
                torch.cat([old, new], dim=2)
                for old, new in zip(self.heads[attn.layer_idx], parts, strict=True)
            )
        self.heads[attn.layer_idx] = parts
        keys, rotated, values = parts
        for b in range(bsz):
            out[b] = self._row(
                attn.scaling, window, b, q[b], keys[b], rotated[b], values[b], cos, sin
            )
        return out.transpose(1, 2).reshape(bsz, c, heads * d)

    def _row(self, scaling, window, b, q, k, k_rot, v, cos, sin) -> torch.Tensor:
        """One row's output ``[H, c, d]`` from its queries ``q [H, c, d]``, its keys per query
        head before RoPE (``k``) and at their base positions (``k_rot``), ``[H, T, d]``, and
        values ``v [H, T, d]``; see the module docstring for the three kinds of query. In a
        sliding layer (``window`` tokens, else ``None``) each query sees only the keys less than
        ``window`` positions from its own, at the positions it gives them.

        A key of passage ``j`` shifted back by ``s`` scores ``<R(m) q, R(n - s) k> =
        <R(m + s) q, R(n) k>`` (RoPE is a rotation by position): the keys are rotated once, at
        their base positions, and each query once per passage, at its position plus that
        passage's shift for it.
        """
        heads, c, d = q.shape
        total = k.shape[1]
        blocks, base = self.blocks[b, :total], self.base[b, :total]
        qi = torch.arange(self.start, self.start + c, device=q.device)
        qblocks = blocks[qi]
        lengths = self.lengths[b]
        n = len(lengths)
        in_region = blocks >= 0
        region = in_region.nonzero().squeeze(-1)  # passage tokens
        # [R, n]; a row without passages (a closed-book prompt) is plain causal attention below
        onehot = torch.nn.functional.one_hot(blocks[region], n).to(q.dtype) if n else None
        doc_of_key = blocks.clamp(min=0)  # a passage index for every key (used where in_region)
        out = torch.zeros(heads, c, d, device=q.device, dtype=q.dtype)
        first = int(region[0]) if len(region) else total
        keys_seen = blocks != PAD
        index = torch.arange(total, device=q.device)
        keys_seen = keys_seen.expand(c, total)

        members = [(blocks == j).nonzero().squeeze(-1) for j in range(n)]

        def attend(rows, shifts, seen):
            # rows [r] query indices into q; shifts [H, r|1, n] per passage; seen [H|1, r, T]
            m = base[qi[rows]]
            if window is not None:  # over the positions the query gives the keys
                at = base[None, None] - torch.where(in_region, shifts[:, :, doc_of_key], 0)
                seen = seen & window_band(m[None, :, None], at, window)
            q0 = _rope(q[:, rows], cos[m], sin[m])  # [H, r, d]
            logits = q0 @ k_rot.transpose(-1, -2)  # [H, r, T]: right for keys outside passages
            for j, keys in enumerate(members):
                at = (m[None] + shifts[:, :, j]).expand(heads, len(rows))
                qj = _rope(q[:, rows], cos[at], sin[at])  # [H, r, d], forward by j's shift
                logits[:, :, keys] = qj @ k_rot[:, keys].transpose(-1, -2)
            logits = (logits * scaling).masked_fill(~seen, float("-inf"))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
            out[:, rows] = probs @ v

        local = torch.arange(c, device=q.device)
        none = torch.zeros(heads, 1, n, dtype=torch.long, device=q.device)
        # prefix queries: ordinary causal attention at base positions
        prefix = local[(qblocks == OUTSIDE) & (qi < first)]
        if len(prefix):
            attend(prefix, none, ((index[None] <= qi[prefix, None]) & keys_seen[prefix])[None])
        # passage queries: the other passages before the query's own, ranked by its importance
        if (qblocks >= 0).any():
            qr, kr = q[:, region - self.start], k[:, region]  # the passage region, without RoPE
            w = (qr @ kr.transpose(-1, -2)) * scaling  # [H, R, R]
            same = blocks[region][:, None] == blocks[region][None, :]
            w = torch.softmax(w.masked_fill(same, float("-inf")), dim=-1, dtype=torch.float32)
            per = (w.to(q.dtype) @ onehot) / lengths  # [H, R, n]: query token -> passage
            doc2doc = onehot.transpose(0, 1) @ per  # [H, n, n]: passage -> passage
            eye = torch.eye(n, dtype=torch.bool, device=q.device)
            doc2doc = doc2doc.masked_fill(eye, torch.finfo(doc2doc.dtype).max)
            shifts = passage_shifts(doc2doc, lengths)  # [H, n (query's passage), n]
            for p in range(n):
                rows = local[qblocks == p]
                if not len(rows):
                    continue
                key_pos = base[None] - torch.where(in_region, shifts[:, p][:, doc_of_key], 0)
                seen = (key_pos[:, None] <= base[qi[rows]][None, :, None]) & keys_seen[rows]
                attend(rows, shifts[:, p][:, None], seen)
        # queries after the passages: per head and query, passages ranked by its importance
        after = local[(qblocks == OUTSIDE) & (qi > first)] if len(region) else local[:0]
        if len(after):
            w = (q[:, after] @ k[:, region].transpose(-1, -2)) * scaling  # [H, a, R]
            w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            shifts = passage_shifts((w @ onehot) / lengths, lengths)  # [H, a, n]
            attend(after, shifts, ((index[None] <= qi[after, None]) & keys_seen[after])[None])
        return out


def _pine_attention_forward(attn, run: _PineRun, hidden_states, *args, **kwargs):
    """Replacement ``forward`` of an attention module during a PINE run: projects q/k/v as the
    family does (:func:`~ragfix.backends.family.project_qkv`) and attends as PINE does over
    ``run``'s cache (which the step's keys and values join). Returns ``(output [B, c, hidden],
    None)``."""
    q, k, v = project_qkv(attn, hidden_states)
    return attn.o_proj(run.attend(attn, q, k, v)), None


class PineBackend(PassageSetBackend):
    """The ``pine`` backend (see the module docstring). Composes with an adapter (merged into the
    weights before the attention is patched); no options.

    Args:
        model, tokenizer, adapter: as for :class:`~ragfix.backends.hf.HFBackend`.
    """

    name: ClassVar[str] = "pine"
    options_model: ClassVar[type[BackendOptions]] = BackendOptions

    @classmethod
    def check_family(cls, family: Family, options: BackendOptions) -> None:
        """PINE rotates each query per passage over whole heads, with plain softmax logits.

        Raises:
            UnsupportedModelError: partial rotary or soft-capped attention logits.
        """
        if family.partial_rotary < 1:
            raise family.refuse("pine", "RoPE rotates only part of each head")
        if family.softcap:
            raise family.refuse("pine", "its attention logits are soft-capped")

    def __init__(self, model, tokenizer, *, adapter: dict | None = None, **options):
        super().__init__(model, tokenizer, adapter=adapter, **options)
        self.attentions = attention_modules(model)

    def _patched(self, run: _PineRun):
        """Route every attention module through PINE while ``run`` steps
        (:func:`~ragfix.backends.patching.routed`).

        Raises:
            IncompatibleMethodsError: another method already patches the attention.
        """
        return routed("pine", self.attentions, _pine_attention_forward, run)

    @torch.no_grad()
    def _run(self, sets: Sequence[PassageSet], extra: Sequence[Sequence[int]] = ()):
        """See :meth:`~ragfix.backends.passages.PassageSetBackend._run`: the prefill through
        PINE attention, decoding over the pre-RoPE cache of the run."""
        run = _PineRun(self, sets, extra)
        keep = 1 + max((len(e) for e in extra), default=0)
        with self._patched(run):
            logits = self.model(input_ids=run.ids, use_cache=False, logits_to_keep=keep).logits

        @torch.no_grad()
        def step(nxt: torch.Tensor) -> torch.Tensor:
            run.start = run.base.shape[1]
            run.grow(nxt.shape[1])
            with self._patched(run):
                return self.model(input_ids=nxt, use_cache=False).logits

        return logits, step


__all__ = ["PineBackend", "passage_shifts"]
