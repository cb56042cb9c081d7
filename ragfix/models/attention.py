"""SDPA attention with float32 decode steps, for bf16 and fp16 models on the CPU.

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
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ragfix.models.device import SDPA_FP32_DECODE

#: the dtypes whose decoding steps are computed in float32
HALF = (torch.bfloat16, torch.float16)


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


AttentionInterface.register(SDPA_FP32_DECODE, sdpa_fp32_decode)
AttentionMaskInterface.register(SDPA_FP32_DECODE, sdpa_mask)
