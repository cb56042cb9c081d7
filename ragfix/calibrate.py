"""Calibration of the ``channel-scaled`` backend: find the positional channel and its scale.

Method: Yu et al., arXiv 2406.02536 (sec. 3.2 and the official code's
``experiments/search_dimension``), in four stages:

A. Mean hidden states over random-character prompts (fp32 accumulation), per layer, position and
   channel.
B. Screening. A channel is a candidate when its mean curve (after skipping the first 30% of the
   positions, min-max normalised) fitted by a cubic is monotone in more than a quarter of the
   layers (the larger of its increasing / decreasing layer sets). Its smoothness is the sum of
   squared second differences of the Savitzky-Golay filtered curve (window 10, order 3; first 20%
   skipped), the minimum over its monotone layers; the ``top_k`` smoothest are kept.
C. The candidates are ranked by the teacher-forced answer loss on generated KV-retrieval prompts
   (gold pair at 1/4, 1/2 and 3/4 depth) with the channel scaled by 0 in the chosen layers; the
   answer tokens and the last prompt token use the scaled attention, as in generation.
D. The factor of the best channel by grid search over ``{0.5, 0, -0.5, -1}`` on the same loss.

Stages C and D share the work of a prompt: the prompt prefix is run once with the unmodified
model, keeping its KV cache and the attention inputs of the scaled layers; each setting then
rebuilds the scaled keys of those layers from the attention inputs and runs only the answer rows.
This equals the full teacher-forced forward (the prefix rows never change) at a fraction of the
cost.

The prompts are built through the model interface (``tokenize``, ``encode``). Reading hidden
states (stage A) and the loss under a candidate scaling (stages C-D, through
:func:`~ragfix.backends.channel_scaling.apply_channel_scaling`) are the method's own internals:
they work on the Hugging Face model, so :func:`calibrate` takes an
:class:`~ragfix.backends.hf.HFBackend` explicitly.
"""

from __future__ import annotations

import random
import string
import time
import uuid

import numpy as np
import torch
from pydantic import BaseModel, Field
from rich.progress import track
from scipy.signal import savgol_filter

from ragfix.backends.base import Backend
from ragfix.backends.channel_scaling import (
    CandidateScore,
    ChannelScalingCalibration,
    apply_channel_scaling,
    attention_modules,
    default_layers,
    scaled_keys,
)
from ragfix.backends.hf import HFBackend
from ragfix.errors import ConfigError, RagfixError
from ragfix.models import model_identity
from ragfix.prompts import TaskPrompt
from ragfix.tasks import get_task, kv_answer_prefix
from ragfix.types import Passage

#: the factor candidates are ranked with (the official code's search setting)
SEARCH_FACTOR = 0.0
#: the paper's factor grid
DEFAULT_FACTORS = (0.5, 0.0, -0.5, -1.0)


class CalibrationError(RagfixError):
    """The calibration found nothing usable (the message says which sizes to raise)."""


class CalibrationSettings(BaseModel):
    """Sizes and seeds of a calibration run.

    Attributes:
        samples: random-character prompts averaged in stage A (paper: 200).
        length: tokens per random-character prompt (paper: 1000).
        kv_examples: KV-retrieval calibration prompts (code default: 60).
        kv_pairs: key-value pairs per calibration prompt (code default: 50).
        layers: decoder layers scaled during the search (default: the middle layers).
        factors: the factor grid of stage D.
        top_k: candidates ranked by loss (code: 10).
        batch_size: prompts per forward in stage A.
        seed: seed of the random text and the KV prompts.
    """

    samples: int = Field(ge=1)
    length: int = Field(ge=32)
    kv_examples: int = Field(ge=1)
    kv_pairs: int = Field(ge=2)
    layers: list[int]
    factors: list[float] = Field(default_factory=lambda: list(DEFAULT_FACTORS), min_length=1)
    top_k: int = Field(default=10, ge=1)
    batch_size: int = Field(default=4, ge=1)
    seed: int = 0

    @classmethod
    def for_backend(cls, backend: HFBackend, **overrides) -> CalibrationSettings:
        """Defaults scaled to the backend's model and device; ``overrides`` (not None) win.

        The prompt length is a quarter of the context window, at most the paper's 1000 tokens.
        On a GPU the paper's sizes are used (200 prompts, 60 KV prompts of 50 pairs); on a CPU
        16 prompts and 18 KV prompts of 8 pairs, so that SmolLM2-135M calibrates on two cores
        in minutes. The default layers are the middle ones of the model
        (:func:`~ragfix.backends.channel_scaling.default_layers`).

        Raises:
            pydantic.ValidationError: an override out of range.
        """
        gpu = backend.device.type == "cuda"
        base = {
            "samples": 200 if gpu else 16,
            "length": min(1000, backend.context_window // 4),
            "kv_examples": 60 if gpu else 18,
            "kv_pairs": 50 if gpu else 8,
            "layers": default_layers(backend.model.config.num_hidden_layers),
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


# --------------------------------------------------------------------------- stage A
def random_text_ids(backend: Backend, samples: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids of ``samples`` random-character strings, each cut to ``length`` tokens.

    The characters are drawn uniformly from letters, digits, punctuation and space and tokenized
    by ``backend.tokenize`` (no special tokens: the official code builds its tokenizer without
    BOS).

    Returns:
        int64 tensor ``[samples, length]``.
    """
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " "
    rows = []
    for _ in range(samples):
        n_chars = 2 * length
        while True:
            text = "".join(rng.choices(alphabet, k=n_chars))
            ids = backend.tokenize(text)
            if len(ids) >= length:
                break
            n_chars *= 2
        rows.append(ids[:length])
    return torch.tensor(rows)


@torch.no_grad()
def mean_hidden_states(
    model, ids: torch.Tensor, batch_size: int = 4, progress: bool = True
) -> torch.Tensor:
    """Mean residual-stream hidden states over prompts (stage A).

    Args:
        ids: ``[N, T]`` prompts of equal length.

    Returns:
        float32 tensor ``[num_layers + 1, T, hidden_size]`` on the CPU (index 0 is the embedding
        output), summed in fp32 and divided by ``N``.
    """
    dev = next(model.parameters()).device
    total = None
    batches = list(torch.split(ids, batch_size))
    for batch in track(batches, description="mean hidden states", disable=not progress):
        out = model(input_ids=batch.to(dev), use_cache=False, output_hidden_states=True)
        hs = torch.stack([h.float().sum(0) for h in out.hidden_states]).cpu()
        total = hs if total is None else total + hs
    return total / ids.shape[0]


# --------------------------------------------------------------------------- stage B
def _minmax(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Columns of ``y`` scaled to [0, 1], and a mask of the non-constant columns."""
    lo, hi = y.min(0), y.max(0)
    ok = hi - lo > 0
    return (y - lo) / np.where(ok, hi - lo, 1.0), ok


def screen_channels(
    mean: np.ndarray, mono_skip: int, smooth_skip: int, top_k: int = 10
) -> list[CandidateScore]:
    """Positional-channel candidates from mean hidden states (stage B).

    Args:
        mean: ``[L, T, D]`` mean hidden states of the ``L`` transformer layers (no embedding
            output).
        mono_skip: first positions skipped by the monotonicity test (code: 300 of 1000).
        smooth_skip: first positions skipped by the smoothness score (code: 200 of 1000).
        top_k: how many candidates to return.

    Returns:
        up to ``top_k`` candidates, smoothest first; empty when no channel is monotone in more
        than ``L // 4`` of the layers ``2 .. L-2``.
    """
    n_layers, _, dim = mean.shape
    test_layers = list(range(2, n_layers - 1))
    inc = np.zeros((n_layers, dim), bool)
    dec = np.zeros((n_layers, dim), bool)
    rough = np.full((n_layers, dim), np.inf)
    for layer in test_layers:
        y, ok = _minmax(mean[layer, mono_skip:, :].astype(np.float64))
        x = np.arange(y.shape[0], dtype=np.float64)
        fitted = np.vander(x, 4) @ np.polyfit(x, y, 3)
        steps = np.diff(fitted, axis=0)
        inc[layer] = ok & (steps >= 0).all(0)
        dec[layer] = ok & (steps <= 0).all(0)
        z, ok_s = _minmax(mean[layer, smooth_skip:, :].astype(np.float64))
        second = np.diff(savgol_filter(z, window_length=10, polyorder=3, axis=0), n=2, axis=0)
        rough[layer] = np.where(ok_s, (second**2).sum(0), np.inf)
    out = []
    for c in range(dim):
        n_inc, n_dec = int(inc[:, c].sum()), int(dec[:, c].sum())
        mono = dec[:, c] if n_dec >= n_inc else inc[:, c]
        layers = [int(i) for i in np.flatnonzero(mono)]
        if len(layers) > n_layers // 4:
            out.append(
                CandidateScore(
                    channel=c,
                    monotone_layers=layers,
                    smoothness=float(rough[layers, c].min()),
                )
            )
    out.sort(key=lambda cand: cand.smoothness)
    return out[:top_k]


# --------------------------------------------------------------------------- stages C and D
def kv_calibration_examples(
    backend: Backend, examples: int, pairs: int, seed: int = 0
) -> list[tuple[list[int], list[int]]]:
    """Generated KV-retrieval calibration prompts (Lost-in-the-Middle KV template, random UUID
    keys and values), the gold pair at 1/4, 1/2 and 3/4 of the context in turn.

    Returns:
        ``(prompt_ids, answer_ids)`` per example: the chat-formatted prompt with the assistant
        turn opened by the answer prefix, and the gold value's tokens.
    """
    rng = random.Random(seed)
    depths = [pairs // 4, pairs // 2, (3 * pairs) // 4]
    out = []
    for i in range(examples):
        kv = [
            Passage(
                title=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                text=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            )
            for _ in range(pairs)
        ]
        gold = kv[depths[i % len(depths)]]
        prompt = TaskPrompt(
            user=get_task("kv").user_turn(gold.title, kv),
            assistant_prefix=kv_answer_prefix(gold.title),
        )
        out.append((backend.encode(prompt), backend.tokenize(gold.text)))
    return out


@torch.no_grad()
def example_losses(
    model,
    prompt_ids: list[int],
    answer_ids: list[int],
    layers: list[int],
    settings: list[tuple[int, float]],
) -> list[float]:
    """Teacher-forced answer loss of one prompt under several (channel, factor) settings.

    The last prompt token and the answer tokens use the scaled attention (``rows =
    len(answer) + 1``, as in generation). The prefix runs once unmodified; per setting, the
    scaled keys of ``layers`` are rebuilt from the captured attention inputs and only the last
    rows are run (exactly the full forward, see the module docstring).

    Returns:
        mean cross-entropy over the answer tokens (nats per token), one per setting.
    """
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = prompt_ids + answer_ids
    r = len(answer_ids) + 1
    prefix = torch.tensor([ids[:-r]], device=dev)
    chunk = torch.tensor([ids[-r:]], device=dev)
    mods = attention_modules(model)
    inputs: dict[int, tuple] = {}

    def grab(layer):
        def hook(_mod, _args, kwargs):
            inputs[layer] = (kwargs["hidden_states"], kwargs["position_embeddings"])

        return hook

    hooks = [mods[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in layers]
    try:
        base = model(input_ids=prefix, use_cache=True).cache
    finally:
        for h in hooks:
            h.remove()
    losses = []
    for channel, factor in settings:
        cache = DynamicCache(config=model.config)
        for i, layer in enumerate(base.layers):
            keys = layer.keys
            if i in inputs:
                keys = scaled_keys(mods[i], *inputs[i], channel, factor)
            cache.update(keys, layer.values, i)
        with apply_channel_scaling(model, channel, layers, factor, rows=r):
            logits = model(input_ids=chunk, cache=cache).logits[0, :-1].float()
        losses.append(torch.nn.functional.cross_entropy(logits, chunk[0, 1:]).item())
    return losses


def _mean_losses(model, examples, layers, settings, description, progress) -> list[float]:
    total = np.zeros(len(settings))
    for prompt_ids, answer_ids in track(examples, description=description, disable=not progress):
        total += example_losses(model, prompt_ids, answer_ids, layers, settings)
    return (total / len(examples)).tolist()


def calibrate(
    backend: HFBackend, settings: CalibrationSettings, progress: bool = True
) -> ChannelScalingCalibration:
    """Find the positional channel, the layers and the factor for ``backend``'s model
    (stages A-D of the module docstring).

    Args:
        backend: an unmodified Hugging Face backend (``vanilla``) of the model to calibrate;
            stages A, C and D run its model directly (the method's internals).
        settings: sizes, layers and factor grid (see :meth:`CalibrationSettings.for_backend`).
        progress: show a progress bar per stage.

    Returns:
        the artefact (not yet saved); ``baseline_loss`` is the unmodified model's loss.

    Raises:
        CalibrationError: no channel passes the monotonicity screen.
        ConfigError: unsupported architecture, or layers out of range.
    """
    start = time.perf_counter()
    model = backend.model
    n_layers = model.config.num_hidden_layers
    if any(not 0 <= i < n_layers for i in settings.layers):
        raise ConfigError(f"layers {settings.layers}: out of range 0..{n_layers - 1}")
    ids = random_text_ids(backend, settings.samples, settings.length, settings.seed)
    mean = mean_hidden_states(model, ids, settings.batch_size, progress)[1:].numpy()
    candidates = screen_channels(
        mean,
        mono_skip=round(0.3 * settings.length),
        smooth_skip=round(0.2 * settings.length),
        top_k=settings.top_k,
    )
    if not candidates:
        raise CalibrationError(
            "no hidden-state channel is monotone in position in more than a quarter of the "
            "layers; raise --samples or --length"
        )
    examples = kv_calibration_examples(
        backend, settings.kv_examples, settings.kv_pairs, settings.seed
    )
    ranking = [(0, 1.0)] + [(c.channel, SEARCH_FACTOR) for c in candidates]
    losses = _mean_losses(model, examples, settings.layers, ranking, "ranking candidates", progress)
    for cand, loss in zip(candidates, losses[1:], strict=True):
        cand.loss = loss
    best = min(candidates, key=lambda c: c.loss)
    factor_losses = {SEARCH_FACTOR: best.loss}
    rest = [f for f in settings.factors if f not in factor_losses]
    if rest:
        grid = _mean_losses(
            model,
            examples,
            settings.layers,
            [(best.channel, f) for f in rest],
            "factor grid",
            progress,
        )
        factor_losses.update(zip(rest, grid, strict=True))
    factor = min(settings.factors, key=lambda f: factor_losses[f])
    return ChannelScalingCalibration(
        model=model_identity(model),
        channel=best.channel,
        layers=settings.layers,
        factor=factor,
        baseline_loss=losses[0],
        factor_losses={str(f): factor_losses[f] for f in settings.factors},
        candidates=candidates,
        settings=settings.model_dump(mode="json"),
        minutes=(time.perf_counter() - start) / 60,
    )
