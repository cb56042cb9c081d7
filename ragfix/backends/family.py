"""What the attention methods share about the model families they reach: the one toolkit they
import (none imports another method).

A method reaches a family through what the family itself defines, never through Llama-shaped
re-implementations: the attention module's own projections (separate ``q/k/v_proj``, or Phi-3's
fused ``qkv_proj``; Qwen3's and Gemma 3's q/k norms), the family's ``apply_rotary_pos_emb`` (Phi-3's
rotates part of each head), the decoder's rotary module (Gemma 3's takes the layer type: local and
global layers have their own RoPE bases), the module's own ``scaling`` (Gemma 3:
``query_pre_attn_scalar ** -0.5``) and each layer's sliding window as transformers itself reads it
from the config (``get_layer_types_and_kwargs``: Mistral slides every layer, Gemma 3 five of six).

Sliding windows. A method that computes its own attention (or builds its own mask) applies a
sliding layer's window on top of its own rule, over the positions it gives the tokens: key ``j``
is visible to query ``i`` only when ``|p_i - p_j| < window`` (transformers'
``sliding_window_overlay`` over positions in order; the same distance after a query, where a
method lets it read later tokens). Where a method keeps the positions as read, that is the
model's own window; where it assigns its own (set-based, PINE), the window follows them, so an
order-invariant method stays order-invariant. A method that keeps a KV cache between calls
keeps every key of every layer (:func:`full_cache`): a sliding-window cache drops keys once its
window is full and cannot be cropped back to a shorter prefix, and the model's own masks still
hold each layer to its window.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch

from ragfix.errors import UnsupportedModelError
from ragfix.models.device import layer_windows, slides

#: what the families are called in refusals and tables (``config.model_type`` -> name)
FAMILY_NAMES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3",
    "gemma3": "Gemma 3",
    "phi3": "Phi-3",
}


def family_name(config) -> str:
    """``"Gemma 3 (gemma3_text)"``: the family of a model config as refusals name it."""
    kind = config.model_type
    return f"{FAMILY_NAMES.get(kind, kind)} ({kind})"


@dataclass(frozen=True)
class Family:
    """What a method needs to know of a model's attention, read from its config alone (nothing
    loaded).

    Attributes:
        model_type: ``config.model_type``.
        name: as :func:`family_name` gives it.
        windows: per decoder layer its sliding window in tokens, or ``None`` for a full layer.
        fused_qkv: one ``qkv_proj`` instead of ``q_proj``, ``k_proj``, ``v_proj`` (Phi-3).
        partial_rotary: the share of each head's channels that RoPE rotates (1.0: all).
        softcap: the attention logits' soft cap (``attn_logit_softcapping``), or ``None``.
        layer_rope: the rotary module takes the layer type (local and global RoPE bases).
    """

    model_type: str
    name: str
    windows: tuple[int | None, ...]
    fused_qkv: bool
    partial_rotary: float
    softcap: float | None
    layer_rope: bool

    @property
    def sliding(self) -> bool:
        """Whether any layer slides a window."""
        return slides(self.windows)

    def refuse(self, method: str, reason: str) -> UnsupportedModelError:
        """The one-line refusal of ``method`` on this family: ``"gali does not support Gemma 3
        (gemma3_text): REASON"``."""
        return UnsupportedModelError(f"{method} does not support {self.name}: {reason}")


#: model types whose attention modules project with ``qkv_proj`` in one matrix
FUSED_QKV_TYPES = frozenset({"phi3"})
#: model types whose decoder's rotary module takes the layer type
LAYER_ROPE_TYPES = frozenset({"gemma3", "gemma3_text"})


def read_family(config) -> Family:
    """The :class:`Family` of a model config (a text config is taken from a multimodal one)."""
    text = config.get_text_config(decoder=True)
    windows = layer_windows(config)
    rope = getattr(text, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    partial = partial or getattr(text, "partial_rotary_factor", None) or 1.0
    return Family(
        model_type=text.model_type,
        name=family_name(text),
        windows=windows,
        fused_qkv=text.model_type in FUSED_QKV_TYPES,
        partial_rotary=float(partial),
        softcap=getattr(text, "attn_logit_softcapping", None),
        layer_rope=text.model_type in LAYER_ROPE_TYPES,
    )


def model_family(model) -> Family:
    """The :class:`Family` of a loaded model (memoised on it)."""
    fam = getattr(model, "_ragfix_family", None)
    if fam is None:
        fam = read_family(model.config)
        model._ragfix_family = fam
    return fam


def project_qkv(attn, hidden_states):
    """The pre-RoPE queries, keys and values of an attention module as its family computes them
    (a fused ``qkv_proj`` split as Phi-3 splits it; Qwen3's and Gemma 3's q/k norms applied).

    Args:
        attn: the attention module.
        hidden_states: ``[B, c, hidden]``.

    Returns:
        ``q [B, H, c, d]``, ``k [B, Hkv, c, d]``, ``v [B, Hkv, c, d]``.
    """
    bsz, c, _ = hidden_states.shape
    shape = (bsz, c, -1, attn.head_dim)
    if hasattr(attn, "qkv_proj"):
        qkv = attn.qkv_proj(hidden_states)
        nq = attn.config.num_attention_heads * attn.head_dim
        nk = attn.config.num_key_value_heads * attn.head_dim
        q, k, v = qkv[..., :nq], qkv[..., nq : nq + nk], qkv[..., nq + nk :]
    else:
        q, k, v = (p(hidden_states) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k, v = q.view(shape), k.view(shape), v.view(shape).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q.transpose(1, 2), k.transpose(1, 2), v


def apply_rotary(attn):
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` of the attention module's family (the
    function its own forward rotates queries and keys with)."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


def layer_window(attn) -> int | None:
    """The sliding window (tokens) of an attention module's layer, or ``None`` for a full one."""
    return model_window(attn.config, attn.layer_idx)


def model_window(config, layer: int) -> int | None:
    """The sliding window of decoder layer ``layer`` of a model config, or ``None``."""
    return read_family(config).windows[layer]


def rotary_tables(model, layer: int, top: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[top, rotary_dim]`` of the decoder's rotary embedding at positions
    ``0 .. top - 1`` as layer ``layer`` uses them (Gemma 3: its layer type's RoPE base)."""
    rotary = model.get_decoder().rotary_emb
    probe = torch.empty(0, device=device, dtype=dtype)
    pos = torch.arange(top, device=device)[None]
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        cos, sin = rotary(probe, pos, model.config.get_text_config().layer_types[layer])
    else:
        cos, sin = rotary(probe, pos)
    return cos[0], sin[0]


def window_band(q_index: torch.Tensor, k_index: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether key ``j`` lies within query ``i``'s sliding window, ``|i - j| < window``
    (broadcast over the two index tensors; all true for ``window=None``)."""
    if window is None:
        shape = torch.broadcast_shapes(q_index.shape, k_index.shape)
        return torch.ones(shape, dtype=torch.bool, device=q_index.device)
    return (q_index - k_index).abs() < window


def layer_masks(model, seen: torch.Tensor, dtype, distance: torch.Tensor | None = None):
    """The additive attention mask a method passes to the model for its own visibility rule
    ``seen`` (``[B, Tq, Tk]`` bool, query ``i`` is token ``Tk - Tq + i``), each sliding layer's
    window applied on top: a key is in the window when ``distance < window``, ``distance``
    (``[B, Tq, Tk]``, tokens) being the query's index minus the key's, or the query's position
    ID minus the key's for a method that assigns its own positions (set-based).

    Returns:
        ``[B, 1, Tq, Tk]`` when every layer has the same window; else ``{"full_attention": ...,
        "sliding_attention": ...}``, one mask per layer type (the form Gemma 3's and Qwen2's
        forwards take).

    Raises:
        UnsupportedModelError: layers with different windows in a family whose forward takes
            one mask for all of them.
    """
    fam = model_family(model)
    tq, tk = seen.shape[-2:]
    qi = torch.arange(tk - tq, tk, device=seen.device)[:, None]
    ki = torch.arange(tk, device=seen.device)[None, :]

    if distance is None:
        distance = (qi - ki)[None]

    def additive(window):
        ok = seen & (distance < window) if window is not None else seen.clone()
        ok |= ~ok.any(-1, keepdim=True) & (qi == ki)  # a row that sees nothing sees itself
        return torch.zeros(ok.shape, dtype=dtype, device=seen.device).masked_fill(
            ~ok, torch.finfo(dtype).min
        )[:, None]

    kinds = set(fam.windows)
    if len(kinds) == 1:
        return additive(fam.windows[0])
    source = inspect.getsource(type(model.get_decoder()).forward)
    if "isinstance(causal_mask_mapping := attention_mask, dict)" not in source:
        raise fam.refuse("a custom attention mask", "its layers slide different windows")
    (window,) = kinds - {None}
    return {"full_attention": additive(None), "sliding_attention": additive(window)}


def full_cache():
    """An empty KV cache that keeps every key and value of every layer (no sliding-window
    layers): it can be cropped to any prefix and read whole; the model's masks still hold each
    sliding layer to its window. Memory: every layer as a full layer."""
    from transformers import DynamicCache

    return DynamicCache()


__all__ = [
    "FAMILY_NAMES",
    "Family",
    "apply_rotary",
    "family_name",
    "full_cache",
    "layer_masks",
    "layer_window",
    "model_family",
    "model_window",
    "project_qkv",
    "read_family",
    "rotary_tables",
    "window_band",
]
