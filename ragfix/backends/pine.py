"""PINE: order-invariant reading of a prompt's passages, positions re-assigned by importance.

Wang et al., "Eliminating Position Bias of Language Models: A Mechanistic Approach" (arXiv
2407.01100, ICLR 2025), section 3; the math of the official code (wzq016/PINE,
``pine/models/llama/modeling_llama.py``, ``LlamaAttentionWithPS.forward``). The prompt is laid
out as a passage set (:func:`~ragfix.backends.set_based.passage_set`: the text before the
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
key back by ``s`` is rotating the query forward by ``s``). Invariant to the order of the
passages by construction (up to floating point and ties in importance); the cost over vanilla is
a score matrix per passage for every query: time grows with (queries) x (passages) x (prompt
tokens).

Like the official code, attention is computed explicitly in this module (any
``attn_implementation``), one prompt of a batch at a time inside each layer (the MLPs and
projections run batched); Llama, Mistral, Qwen2 and Qwen3 attention modules (Qwen3's q/k norms
applied before RoPE). Refuses prompts without passage spans, and a model whose attention another
method already patches, in one line.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

import torch

from ragfix.backends.base import BackendOptions
from ragfix.backends.patching import attention_modules, patch_attention
from ragfix.backends.set_based import (
    OUTSIDE,
    PAD,
    PassageSet,
    PassageSetBackend,
    padded_batch,
)


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
    base positions and blocks of its tokens, the pre-RoPE keys and values of every layer and the
    RoPE tables."""

    def __init__(self, backend: PineBackend, sets: Sequence[PassageSet], extra=()):
        batch = padded_batch(sets, extra, "end", backend.tokenizer.pad_token_id)
        self.ids = batch.ids.to(backend.device)
        self.base = batch.positions.to(backend.device)  # [B, T]
        self.blocks = batch.blocks.to(backend.device)  # [B, T]
        self.lengths = [
            torch.tensor([len(p) for p in s.passages], device=backend.device) for s in sets
        ]
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.start = 0  # index of the step's first query
        self.rotary = backend.rotary
        self.device = backend.device
        self._tables = None

    def grow(self, c: int) -> None:
        """Add ``c`` generated tokens: outside the passages, positions after each row's last."""
        b = self.base.shape[0]
        last = self.base[:, -1:]
        steps = torch.arange(1, c + 1, device=self.device)[None]
        self.base = torch.cat([self.base, last + steps], dim=1)
        more = torch.full((b, c), OUTSIDE, device=self.device, dtype=self.blocks.dtype)
        self.blocks = torch.cat([self.blocks, more], dim=1)

    def tables(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[N, d]`` of the model's rotary embedding, up to the largest base
        position plus the passages' summed length (a query rotated forward by a shift)."""
        top = int(self.base.max()) + 1 + max(int(x.sum()) for x in self.lengths)
        if self._tables is None or self._tables[0].shape[0] < top or self._tables[0].dtype != dtype:
            probe = torch.empty(0, device=self.device, dtype=dtype)
            pos = torch.arange(top, device=self.device)[None]
            cos, sin = self.rotary(probe, pos)
            self._tables = (cos[0], sin[0])
        return self._tables

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """PINE attention of the step's queries over every cached key.

        Args:
            attn: the layer's attention module (``scaling``).
            q: pre-RoPE queries ``[B, H, c, d]``; k, v: pre-RoPE keys / values ``[B, Hkv, T, d]``.

        Returns:
            ``[B, c, H * d]`` attention output (before ``o_proj``).
        """
        bsz, heads, c, d = q.shape
        groups = heads // k.shape[1]
        out = torch.zeros(bsz, heads, c, d, device=q.device, dtype=q.dtype)
        cos, sin = self.tables(q.dtype)
        for b in range(bsz):
            kb = k[b].repeat_interleave(groups, dim=0)  # [H, T, d]
            vb = v[b].repeat_interleave(groups, dim=0)
            out[b] = self._row(attn.scaling, b, q[b], kb, vb, cos, sin)
        return out.transpose(1, 2).reshape(bsz, c, heads * d)

    def _row(self, scaling, b, q, k, v, cos, sin) -> torch.Tensor:
        """One row's output ``[H, c, d]``; see the module docstring for the three kinds of
        query.

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
        onehot = torch.nn.functional.one_hot(blocks[region], n).to(q.dtype)  # [R, n]
        doc_of_key = blocks.clamp(min=0)  # a passage index for every key (used where in_region)
        out = torch.zeros(heads, c, d, device=q.device, dtype=q.dtype)
        first = int(region[0]) if len(region) else total
        keys_seen = blocks != PAD
        k_rot = _rope(k, cos[base], sin[base])  # [H, T, d] at base positions
        index = torch.arange(total, device=q.device)

        def attend(rows, shifts, seen):
            # rows [r] query indices into q; shifts [H, r|1, n] per passage; seen [H|1, r, T]
            m = base[qi[rows]]
            q0 = _rope(q[:, rows], cos[m], sin[m])  # [H, r, d]
            logits = q0 @ k_rot.transpose(-1, -2)  # [H, r, T]
            if n:
                at = (m[None, :, None] + shifts).expand(heads, len(rows), n)
                qd = _rope(q[:, rows, None], cos[at], sin[at])  # [H, r, n, d]
                per = torch.einsum("hrnd,htd->hrnt", qd, k_rot)
                pick = doc_of_key[None, None, None].expand(heads, len(rows), 1, total)
                logits = torch.where(in_region, per.gather(2, pick).squeeze(2), logits)
            logits = (logits * scaling).masked_fill(~seen, float("-inf"))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
            out[:, rows] = probs @ v

        local = torch.arange(c, device=q.device)
        none = torch.zeros(heads, 1, n, dtype=torch.long, device=q.device)
        # prefix queries: ordinary causal attention at base positions
        prefix = local[(qblocks == OUTSIDE) & (qi < first)]
        if len(prefix):
            attend(prefix, none, ((index[None] <= qi[prefix, None]) & keys_seen)[None])
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
                seen = (key_pos[:, None] <= base[qi[rows]][None, :, None]) & keys_seen
                attend(rows, shifts[:, p][:, None], seen)
        # queries after the passages: per head and query, passages ranked by its importance
        after = local[(qblocks == OUTSIDE) & (qi > first)] if len(region) else local[:0]
        if len(after):
            w = (q[:, after] @ k[:, region].transpose(-1, -2)) * scaling  # [H, a, R]
            w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            shifts = passage_shifts((w @ onehot) / lengths, lengths)  # [H, a, n]
            attend(after, shifts, ((index[None] <= qi[after, None]) & keys_seen)[None])
        return out


def _pine_attention_forward(attn, run: _PineRun, hidden_states, *args, **kwargs):
    """Replacement ``forward`` of a Llama/Mistral/Qwen2/Qwen3 attention module during a PINE run:
    projects q/k/v (Qwen3's q/k norms applied), caches the pre-RoPE keys and values in ``run``
    and attends as PINE does. Returns ``(output [B, c, hidden], None)``."""
    bsz, c, _ = hidden_states.shape
    shape = (bsz, c, -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(shape)
    k = attn.k_proj(hidden_states).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
    i = attn.layer_idx
    if i in run.keys:
        k = torch.cat([run.keys[i], k], dim=2)
        v = torch.cat([run.values[i], v], dim=2)
    run.keys[i], run.values[i] = k, v
    return attn.o_proj(run.attend(attn, q, k, v)), None


class PineBackend(PassageSetBackend):
    """The ``pine`` backend (see the module docstring). Composes with an adapter (merged into the
    weights before the attention is patched); no options.

    Args:
        model, tokenizer, adapter: as for :class:`~ragfix.backends.hf.HFBackend`.
    """

    name: ClassVar[str] = "pine"
    options_model: ClassVar[type[BackendOptions]] = BackendOptions

    def __init__(self, model, tokenizer, *, adapter: dict | None = None, **options):
        super().__init__(model, tokenizer, adapter=adapter, **options)
        self.attentions = attention_modules(model)
        self.rotary = model.get_decoder().rotary_emb

    @contextmanager
    def _patched(self, run: _PineRun) -> Iterator[None]:
        """Route every attention module through PINE while ``run`` steps.

        Raises:
            IncompatibleMethodsError: another method already patches the attention.
        """

        def forward(attn, *args, **kwargs):
            return _pine_attention_forward(attn, run, *args, **kwargs)

        with patch_attention("pine", self.attentions, forward):
            yield

    @torch.no_grad()
    def _run(self, sets: Sequence[PassageSet], extra: Sequence[Sequence[int]] = ()):
        """See :meth:`~ragfix.backends.set_based.PassageSetBackend._run`: the prefill through
        PINE attention, decoding over the pre-RoPE cache of the run."""
        run = _PineRun(self, sets, extra)
        with self._patched(run):
            logits = self.model(input_ids=run.ids, use_cache=False).logits

        @torch.no_grad()
        def step(nxt: torch.Tensor) -> torch.Tensor:
            run.start = run.base.shape[1]
            run.grow(nxt.shape[1])
            with self._patched(run):
                return self.model(input_ids=nxt, use_cache=False).logits

        return logits, step


__all__ = ["PineBackend", "passage_shifts"]
