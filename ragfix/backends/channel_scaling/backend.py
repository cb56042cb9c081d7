"""The ``channel-scaled`` backend: positional hidden-state channel scaling.

Method: Yu et al., "Mitigate Position Bias in LLMs via Scaling a Single Hidden States Channel"
(arXiv 2406.02536, ACL Findings 2025; official code ``PositionalHidden/PositionalHidden``,
``modeling_llama_hidden_scale.py``). One channel ``d`` of the residual stream carries absolute
position. In the chosen (middle) layers, the query of the last token and the keys of all positions
are computed from the attention input with channel ``d`` multiplied by a factor ``s`` (0 removes it,
-1 flips it); values, and the attention rows of the prompt tokens, stay as they are. The KV cache
holds the scaled keys, so every generated token attends with the scaled query and keys.

Because ``q_proj`` and ``k_proj`` are linear, scaling one input channel is a rank-1 correction of
the projections: ``q~ = q + (s - 1) * h[..., d] * W_q[:, d]`` (the bias is unchanged), and the
same for ``k``. That correction is what :func:`apply_channel_scaling` adds to the attention modules
of the chosen layers (Llama, Mistral, Qwen2, Qwen3 and Gemma attention of transformers 5;
grouped-query attention included; ``eager``, ``sdpa`` and ``sdpa_fp32_decode`` attention). The
patch is reversible.

Where the settings come from, in order of precedence: explicit ``channel`` / ``layers`` /
``factor`` options, a calibration file written by ``ragfix calibrate``
(:class:`ChannelScalingCalibration`), a published preset (:data:`PRESETS`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, Field, ValidationError

from ragfix.backends.base import BackendOptions
from ragfix.backends.channel_scaling.options import PRESETS, ChannelScalingOptions, default_layers
from ragfix.backends.family import Family, apply_rotary, model_family
from ragfix.backends.hf import HFBackend
from ragfix.backends.patching import AttentionPatch, attention_modules, patch_attention
from ragfix.errors import ConfigError, DataError
from ragfix.fingerprint import content_fingerprint
from ragfix.io import atomic_write_json
from ragfix.models.device import SDPA_BANDED, SDPA_FP32_DECODE
from ragfix.models.load import model_identity, weights_differ

#: families whose attention modules the patch understands (separate q/k/v/o_proj, RoPE)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text")
#: attention implementations the patch computes correctly
SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa", SDPA_FP32_DECODE, SDPA_BANDED)

CALIBRATION_FORMAT = "ragfix.channel-scaling/1"


# --------------------------------------------------------------------------- the patch
@dataclass
class _ScalingState:
    """Shared by the patched layers: the channel, the factor and how many final rows of a forward
    use the scaled attention (1 for generation; ``len(answer) + 1`` for a teacher-forced loss)."""

    channel: int
    factor: float
    rows: int = 1
    layers: list[int] = field(default_factory=list)


def _heads(attn, lin: torch.Tensor, norm) -> torch.Tensor:
    """``[B, T, n * head_dim]`` -> ``[B, n, T, head_dim]`` (through Qwen3's per-head norm)."""
    x = lin.view(*lin.shape[:-1], -1, attn.head_dim)
    if norm is not None:
        x = norm(x)
    return x.transpose(1, 2)


def _rank1(lin: torch.Tensor, h: torch.Tensor, proj, channel: int, factor: float) -> torch.Tensor:
    """``proj(h)`` with input channel ``channel`` scaled by ``factor``, from ``lin = proj(h)``:
    ``lin + (factor - 1) * h[..., channel] * W[:, channel]``."""
    return lin + ((factor - 1.0) * h[..., channel : channel + 1]) * proj.weight[:, channel]


def scaled_keys(attn, h: torch.Tensor, position_embeddings, channel: int, factor: float):
    """Rotated keys of ``attn`` computed from ``h`` with channel ``channel`` scaled by ``factor``.

    Args:
        attn: a patched-family attention module.
        h: attention input (post input-norm hidden states), ``[B, T, hidden_size]``.
        position_embeddings: ``(cos, sin)``, each ``[B, T, head_dim]``.

    Returns:
        ``[B, num_key_value_heads, T, head_dim]``.
    """
    k = _heads(attn, _rank1(attn.k_proj(h), h, attn.k_proj, channel, factor), _norm(attn, "k"))
    cos, sin = position_embeddings
    return apply_rotary(attn)(k, k, cos, sin)[1]


def _norm(attn, which: str):
    return getattr(attn, f"{which}_norm", None)


def _rows_mask(mask: torch.Tensor | None, r: int, kv_len: int, attn, like: torch.Tensor):
    """The attention mask of the last ``r`` query rows against ``kv_len`` keys.

    A 4D mask is sliced. Without a mask (SDPA on unpadded input), one row needs none; several rows
    get an explicit bottom-right causal mask, because SDPA's ``is_causal`` is top-left aligned.
    """
    if mask is not None:
        return mask[:, :, -r:, :]
    if r == 1:
        return None
    rows = torch.arange(kv_len - r, kv_len, device=like.device)[:, None]
    allowed = (torch.arange(kv_len, device=like.device)[None, :] <= rows)[None, None]
    if attn.config._attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill(
            ~allowed, torch.finfo(like.dtype).min
        )
    return allowed


def _scaled_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    cache=None,
    **kwargs,
):
    """Attention forward with channel scaling (bound to the attention module of a chosen layer).

    Rows ``0 .. T-r-1`` are the normal causal attention of unscaled ``q``, ``k``, ``v``; the last
    ``r`` rows are ``softmax(q~ k~^T / sqrt(head_dim) + mask) v`` (paper eq. for ``z_l``; code
    ``last_recompute_tokens``). The cache receives ``k~`` and the unscaled ``v``.

    Raises:
        RuntimeError: more than ``r`` new rows over a non-empty cache (chunked prefill, prefix
            reuse): their normal attention would need the unscaled keys the cache no longer holds.
    """
    state: _ScalingState = self._ragfix_channel_scaling
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    bsz, t, _ = hidden_states.shape
    r = min(state.rows, t)
    d, s = state.channel, state.factor
    rope = apply_rotary(self)
    cos, sin = position_embeddings
    q_lin = self.q_proj(hidden_states)
    k_lin = self.k_proj(hidden_states)
    v = _heads(self, self.v_proj(hidden_states), None)
    q_s = _heads(
        self, _rank1(q_lin[:, -r:], hidden_states[:, -r:], self.q_proj, d, s), _norm(self, "q")
    )
    k_s = _heads(self, _rank1(k_lin, hidden_states, self.k_proj, d, s), _norm(self, "k"))
    if r == t:  # decoding (or teacher-forced rows only): every row is scaled
        q_s, k_s = rope(q_s, k_s, cos, sin)
    else:
        q_s, _ = rope(q_s, q_s, cos[:, -r:], sin[:, -r:])
        _, k_s = rope(k_s, k_s, cos, sin)
    if cache is not None:
        if r < t and cache.get_seq_length(self.layer_idx) > 0:
            raise RuntimeError(
                "channel-scaled: a multi-token forward over a non-empty KV cache (chunked prefill "
                "or prefix reuse) is not supported; prefill the whole prompt at once"
            )
        keys, values = cache.update(k_s, v, self.layer_idx, kwargs=kwargs)
    else:
        keys, values = k_s, v
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, sys.modules[type(self).__module__].eager_attention_forward
    )
    rows, _ = interface(
        self,
        q_s,
        keys,
        values,
        _rows_mask(attention_mask, r, keys.shape[-2], self, q_s),
        dropout=0.0,
        scaling=self.scaling,
        **kwargs,
    )
    if r < t:
        q, k = rope(
            _heads(self, q_lin, _norm(self, "q")), _heads(self, k_lin, _norm(self, "k")), cos, sin
        )
        out, _ = interface(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        out[:, -r:] = rows
    else:
        out = rows
    return self.o_proj(out.reshape(bsz, t, -1).contiguous()), None


class ChannelScaling:
    """Handle of an applied channel scaling: :meth:`remove` restores the original forwards;
    :meth:`rows` sets how many final rows of a forward use the scaled attention.

    Use as a context manager to remove on exit.
    """

    def __init__(self, model, state: _ScalingState, patch: AttentionPatch):
        self.model = model
        self.state = state
        self._patch = patch

    @contextlib.contextmanager
    def rows(self, r: int) -> Iterator[None]:
        """Within the block, the last ``r`` rows of each forward use the scaled attention (the
        code's ``last_recompute_tokens``; teacher forcing an answer of ``n`` tokens needs
        ``n + 1``)."""
        old, self.state.rows = self.state.rows, r
        try:
            yield
        finally:
            self.state.rows = old

    def remove(self) -> None:
        """Restore the original attention forwards (idempotent)."""
        for m in self._patch.modules:
            m.__dict__.pop("_ragfix_channel_scaling", None)
        self._patch.remove()

    def __enter__(self) -> ChannelScaling:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def check_channel_family(family: Family) -> None:
    """Refuse a family the patch does not understand.

    Raises:
        UnsupportedModelError: a family outside :data:`SUPPORTED_MODEL_TYPES` (Phi-3 fuses the
            projections the rank-1 correction acts on into one ``qkv_proj``).
    """
    if family.model_type not in SUPPORTED_MODEL_TYPES:
        why = (
            "it fuses q, k and v into one qkv_proj, and the rank-1 correction acts on q_proj and "
            "k_proj"
            if family.fused_qkv
            else f"the patch knows the attention of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
        raise family.refuse("channel-scaled", why)


def apply_channel_scaling(
    model, channel: int, layers: list[int], factor: float, rows: int = 1
) -> ChannelScaling:
    """Patch the attention of ``layers`` so that channel ``channel`` of the attention input is
    scaled by ``factor`` in the last token's query and in all keys (arXiv 2406.02536, sec. 3).

    Args:
        model: a transformers 5 causal LM of the Llama, Mistral, Qwen2, Qwen3 or Gemma family.
        channel: index into ``hidden_size``.
        layers: 0-based decoder layer indices.
        factor: the scale (1 leaves the model unchanged).
        rows: final rows of each forward that use the scaled attention.

    Returns:
        a :class:`ChannelScaling` handle (``remove()`` undoes the patch).

    Raises:
        ConfigError: unsupported architecture or attention implementation, channel or layer
            out of range.
        IncompatibleMethodsError: a chosen layer's attention is already patched (by channel
            scaling or another method).
    """
    cfg = model.config
    impl = cfg._attn_implementation
    check_channel_family(model_family(model))
    mods = attention_modules(model)
    if impl not in SUPPORTED_IMPLEMENTATIONS:
        raise ConfigError(
            f"channel scaling supports attn_implementation {' or '.join(SUPPORTED_IMPLEMENTATIONS)}"
            f", not {impl!r}"
        )
    if not 0 <= channel < cfg.hidden_size:
        raise ConfigError(f"channel {channel} out of range 0..{cfg.hidden_size - 1}")
    bad = [i for i in layers if not 0 <= i < len(mods)]
    if bad or not layers:
        raise ConfigError(f"layers {bad or layers} out of range 0..{len(mods) - 1}")
    state = _ScalingState(channel, float(factor), rows, sorted(layers))
    chosen = [mods[i] for i in state.layers]
    patch = patch_attention("channel-scaled", chosen, _scaled_forward)
    for m in chosen:
        m._ragfix_channel_scaling = state
    return ChannelScaling(model, state, patch)


# --------------------------------------------------------------------------- the artefact
class CandidateScore(BaseModel):
    """One candidate channel of the calibration.

    Attributes:
        channel: index into ``hidden_size``.
        monotone_layers: layers where the channel's mean curve is monotone in position.
        smoothness: sum of squared second differences of the smoothed curve (lower = smoother),
            the minimum over ``monotone_layers``.
        loss: teacher-forced answer loss on the tune prompts with the channel scaled by the
            search factor (nats per token); ``None`` if not ranked by loss.
        gap: the same prompts' largest minus smallest mean loss over the gold depths, averaged
            over the tasks (nats per token); ``None`` if not ranked.
    """

    channel: int
    monotone_layers: list[int]
    smoothness: float
    loss: float | None = None
    gap: float | None = None


class SettingScore(BaseModel):
    """The calibration scores of one (channel, factor) setting on a set of prompts.

    Attributes:
        channel: index into ``hidden_size``; ``None`` for the unmodified model.
        factor: the scale of the channel (1 leaves the model unchanged).
        loss: mean teacher-forced loss of the bare answers (nats per answer token).
        gap: per task, the largest minus the smallest depth mean of the loss, averaged over the
            tasks (nats per token).
        by_depth: ``"task@depth"`` -> mean loss of the prompts with the gold item at that
            0-based depth.
    """

    channel: int | None
    factor: float
    loss: float
    gap: float
    by_depth: dict[str, float] = Field(default_factory=dict)


class StabilityCheck(BaseModel):
    """Whether the screening's candidates survive a change of the random text.

    Attributes:
        seeds: the two random-text seeds.
        top_k: the length of each candidate list.
        shared: channels in both lists.
        other_candidates: the second seed's candidates, smoothest first.
    """

    seeds: list[int]
    top_k: int
    shared: int
    other_candidates: list[int]


class ChannelScalingCalibration(BaseModel):
    """The calibration artefact written by ``ragfix calibrate`` (JSON).

    Attributes:
        format: ``"ragfix.channel-scaling/1"``.
        model: :func:`ragfix.models.load.model_identity` of the calibrated model.
        channel, layers, factor: the chosen settings.
        baseline_loss: tune loss of the unmodified model (nats per answer token).
        factor_losses: factor (as a string) -> tune loss of the best candidate channel.
        candidates: every screened candidate, smoothest first, with its tune loss and gap.
        settings: the sizes, data and seeds that produced the file.
        minutes: wall time of the calibration.
        objective: ``"loss"`` or ``"gap"``, what the selection minimised.
        beats_unmodified: whether a scaled setting beat the unmodified model on the held-out
            prompts; when not, ``factor`` is 1 (the model is left unchanged) and ``channel`` is
            the best tuned one.
        tune: the unmodified model, then every tuned setting, best first.
        heldout: the unmodified model and the finalists on the held-out prompts.
        stability: the two-seed screening check, if run.
        prompts: the number of tune and held-out prompts.
    """

    format: Literal["ragfix.channel-scaling/1"] = CALIBRATION_FORMAT
    model: dict
    channel: int = Field(ge=0)
    layers: list[int] = Field(min_length=1)
    factor: float
    baseline_loss: float
    factor_losses: dict[str, float]
    candidates: list[CandidateScore]
    settings: dict
    minutes: float
    objective: Literal["loss", "gap"] = "loss"
    beats_unmodified: bool | None = None
    tune: list[SettingScore] = Field(default_factory=list)
    heldout: list[SettingScore] = Field(default_factory=list)
    stability: StabilityCheck | None = None
    prompts: dict[str, int] = Field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write the artefact as JSON, atomically (a reader never sees half a file)."""
        atomic_write_json(path, self.model_dump(mode="json"))

    @classmethod
    def load(cls, path: str | Path, model=None) -> ChannelScalingCalibration:
        """Read an artefact; with ``model``, check that it was calibrated for that model.

        Raises:
            ConfigError: no such file, or the file belongs to another model: another
            ``fingerprint``, or other ``weights`` when both identities name weight files
            (:func:`ragfix.models.load.weights_differ`).
            ragfix.connectors.jsonl.DataError: not JSON, or a field is missing/invalid (the
                message names the file and the field).
            ValueError: the file belongs to another model (both identities are named).
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"calibration file not found: {p}")
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(p, e.lineno, None, f"not JSON: {e.msg}") from None
        try:
            cal = cls.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first["loc"]) or None
            raise DataError(p, None, loc, first["msg"]) from None
        if model is not None:
            mine = model_identity(model)
            if cal.model.get("fingerprint") != mine["fingerprint"]:
                raise ConfigError(
                    f"{p}: calibrated for model {cal.model.get('name')!r} "
                    f"(fingerprint {cal.model.get('fingerprint')}), not for {mine['name']!r} "
                    f"(fingerprint {mine['fingerprint']}); run `ragfix calibrate` for this model"
                )
            if weights_differ(cal.model, mine):
                raise ConfigError(
                    f"{p}: calibrated for model {cal.model.get('name')!r} (weights "
                    f"{cal.model.get('weights')}), not for {mine['name']!r} (weights "
                    f"{mine['weights']}); run `ragfix calibrate` for this model"
                )
        return cal


# --------------------------------------------------------------------------- the backend
class ChannelScalingBackend(HFBackend):
    """The model with one positional hidden-state channel scaled in the middle layers
    (arXiv 2406.02536). See the module docstring.

    Attributes:
        scaling: the applied :class:`ChannelScaling` (``scaling.state`` has channel, layers,
            factor).
        source: where the settings came from (``"calibration:<path>"``, ``"preset:<name>"``,
            ``"options"``).
        calibration_fingerprint: :func:`ragfix.fingerprint.content_fingerprint` of the calibration
            file as it was read, or ``None`` without one.

    Raises (constructor):
        pydantic.ValidationError: invalid options.
        FileNotFoundError, DataError, ValueError: a bad calibration file, a file or preset for
            another model, an unsupported architecture.
    """

    name = "channel-scaled"
    options_model = ChannelScalingOptions
    #: the cache holds scaled keys, but the prompt rows after a reused prefix need unscaled ones
    supports_prefix_reuse = False
    #: its patch scales the prompt's rows of each batch, not a cache grown row by row
    supports_step_decoding = False

    @classmethod
    def check_family(cls, family: Family, options: BackendOptions) -> None:
        """See :func:`check_channel_family`."""
        check_channel_family(family)

    def __init__(self, model, tokenizer, *, adapter: dict | None = None, **options):
        super().__init__(model, tokenizer, adapter=adapter, **options)
        o = self.options
        n_layers = model.config.num_hidden_layers
        channel, layers, factor, self.source = None, default_layers(n_layers), 0.0, "options"
        self.calibration_fingerprint: str | None = None
        if o.calibration:
            cal = ChannelScalingCalibration.load(o.calibration, model)
            self.calibration_fingerprint = content_fingerprint(o.calibration)
            channel, layers, factor = cal.channel, cal.layers, cal.factor
            self.source = f"calibration:{o.calibration}"
            if cal.beats_unmodified is False and o.factor is None:
                warnings.warn(
                    f"{o.calibration}: no scaled setting beat the unmodified model on the "
                    "held-out calibration prompts; its factor 1 leaves the model unchanged",
                    UserWarning,
                    stacklevel=2,
                )
        elif o.preset:
            p = PRESETS[o.preset]
            if (p.hidden_size, p.num_layers) != (model.config.hidden_size, n_layers):
                raise ConfigError(
                    f"preset {o.preset!r} is for a model with hidden_size {p.hidden_size} and "
                    f"{p.num_layers} layers; this model has {model.config.hidden_size} and "
                    f"{n_layers}"
                )
            channel, layers, factor = p.channel, list(p.layers), p.factor
            self.source = f"preset:{o.preset}"
        self.scaling = apply_channel_scaling(
            model,
            o.channel if o.channel is not None else channel,
            o.layers if o.layers is not None else layers,
            o.factor if o.factor is not None else factor,
        )

    def identity(self) -> dict:
        """Model identity, backend options and ``scaling``: the applied channel, layers and
        factor, their source and, with a calibration file, its content fingerprint
        (``calibration``)."""
        st = self.scaling.state
        scaling = {
            "channel": st.channel,
            "layers": st.layers,
            "factor": st.factor,
            "source": self.source,
        }
        if self.calibration_fingerprint is not None:
            scaling["calibration"] = self.calibration_fingerprint
        return {**super().identity(), "scaling": scaling}
