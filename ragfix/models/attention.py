"""SDPA attention for the CPU: float32 decode steps for bf16 and fp16 models, and banded
prefill for sliding-window layers.

PyTorch's CPU SDPA kernel is slow for one query row in bf16 (measured on SmolLM2-135M, one
thread, a 600-token prompt: 75 ms per decoded token in bf16 against 64 ms in fp32; the
kernel alone 723 us per call against 185 us, docs/results.md "bf16 on the CPU"). Upcasting
the single query row, the cached keys and the values to float32 for that call computes the
attention in fp32 (exact softmax accumulation, the dtype every other ragfix readout uses) and
decodes at 56 ms per token. Prefill (several query rows) stays bf16 SDPA, where the kernel is
fast.

:data:`SDPA_FP32_DECODE` is the name this implementation is registered under with
transformers' ``AttentionInterface`` (the attention function) and ``AttentionMaskInterface``
(SDPA's own masks), so a model loaded with ``attn_implementation=SDPA_FP32_DECODE`` uses it
and no other model is touched. :func:`ragfix.models.load.load_model` chooses it by default
for a bf16 or fp16 model on the CPU
(:func:`ragfix.models.device.default_attention`).

A sliding-window layer (Gemma 3's local layers, Mistral's window) lets each query row see its
last ``window`` keys, but SDPA with the layer's mask computes every query against every key
and masks afterwards: at 3,500 tokens and a 512-token window, 85% of that work is thrown away
(Gemma 3 270M answering 20 SQuAD paragraphs spends most of its prefill there). :data:`SDPA_BANDED`
(:func:`sdpa_banded`) computes the query rows in blocks of :data:`BAND_ROWS`, each against the
span of keys its rows' mask allows, with the mask's own slice: the same keys and the same
masked softmax per row, with the kernel summing over fewer (all-masked) keys, so the result
equals SDPA's up to float rounding (tested against SDPA and a by-hand softmax). Decode steps
are :func:`sdpa_fp32_decode`'s. :func:`ragfix.models.load.load_model` chooses it on the CPU
for a model with sliding-window layers; another name, so a run's identity tells it from SDPA.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ragfix.models.device import SDPA_BANDED, SDPA_FP32_DECODE

#: the dtypes whose decoding steps are computed in float32
HALF = (torch.bfloat16, torch.float16)
#: query rows per block of :func:`sdpa_banded`: the fastest of 64, 128, 256 and 512 at every length
#: measured (Gemma 3 270M, bf16, 1,000-3,500 tokens: ``results/bench-band-gemma3-bf16.json``)
BAND_ROWS = 64


def sdpa_fp32_decode(module, query, key, value, attention_mask, **kwargs):
    """Transformers' SDPA attention, except that a forward of one query row (a decode step)
    in bf16 or fp16 is computed in float32 and cast back.

    Args:
        module: the attention module (transformers' attention-function contract).
        query: ``(batch, heads, q_len, head_dim)``.
        key, value: ``(batch, kv_heads, kv_len, head_dim)`` (grouped-query heads repeated by
            SDPA's own rule).
        attention_mask: SDPA's mask (boolean, ``True`` = attend, or additive float) or None.
        **kwargs: as for ``sdpa_attention_forward`` (``scaling``, ``dropout``, ``is_causal``,
            ``sliding_window`` ...).

    Returns:
        ``(attn_output (batch, q_len, heads, head_dim) in query's dtype, None)``.
    """
    if query.shape[2] != 1 or query.dtype not in HALF:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


def sdpa_banded(module, query, key, value, attention_mask, band_rows: int = BAND_ROWS, **kwargs):
    """:func:`sdpa_fp32_decode`, except that a sliding-window layer's forward of more than
    ``band_rows`` query rows with a boolean mask is computed in blocks of that many rows,
    each against the keys from the first to the last one its rows' mask allows (the keys
    outside are masked for every row of the block, so each row's softmax is over the same keys).

    Args and returns: as for :func:`sdpa_fp32_decode` (``sliding_window`` in ``kwargs`` marks a
    sliding-window layer).
    """
    rows = query.shape[2]
    if (
        not kwargs.get("sliding_window")
        or rows <= band_rows
        or attention_mask is None
        or attention_mask.dtype != torch.bool
    ):
        return sdpa_fp32_decode(module, query, key, value, attention_mask, **kwargs)
    blocks = []
    for start in range(0, rows, band_rows):
        stop = min(start + band_rows, rows)
        mask = attention_mask[:, :, start:stop]
        seen = mask.any(dim=(0, 1, 2)).nonzero()
        first, last = (int(seen[0]), int(seen[-1]) + 1) if len(seen) else (0, 1)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:stop],
            key[:, :, first:last],
            value[:, :, first:last],
            mask[..., first:last],
            **kwargs,
        )
        blocks.append(out)
    return torch.cat(blocks, dim=1), None


AttentionInterface.register(SDPA_FP32_DECODE, sdpa_fp32_decode)
AttentionMaskInterface.register(SDPA_FP32_DECODE, sdpa_mask)
AttentionInterface.register(SDPA_BANDED, sdpa_banded)
AttentionMaskInterface.register(SDPA_BANDED, sdpa_mask)
