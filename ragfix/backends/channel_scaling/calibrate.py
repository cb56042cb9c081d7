"""Calibration of the ``channel-scaled`` backend: find the positional channel and its scale.

Method: Yu et al., arXiv 2406.02536 (sec. 3.2 and the official code's
``experiments/search_dimension``), in five stages:

A. Mean hidden states over random-character prompts (fp32 accumulation), per layer, position and
   channel.
B. Screening. A channel is a candidate when its mean curve (after skipping the first 30% of the
   positions, min-max normalised) fitted by a cubic is monotone in more than a quarter of the
   layers (the larger of its increasing / decreasing layer sets). Its smoothness is the sum of
   squared second differences of the Savitzky-Golay filtered curve (window 10, order 3; first 20%
   skipped), the minimum over its monotone layers; the ``top_k`` smoothest are kept. With a
   second seed, A-B run again and the overlap of the two top-k lists is recorded (stability).
C. The candidates are ranked by the teacher-forced loss of the bare answer on the tune half of
   the calibration set, with the channel scaled by 0 in the chosen layers; the answer tokens and
   the last prompt token use the scaled attention, as in generation. The set is the official
   one's mix: generated KV-retrieval prompts and (with a QA file) NQ prompts, gold at 1/4, 1/2
   and 3/4 depth, the answer right after the generation prompt.
D. The factor of the best channel by grid search over ``{0.5, 0, -0.5, -1}`` on the same loss.
E. Selection on the held-out half: the best tuned settings and the unmodified model; the
   unmodified model can win (the official code lists a "baseline" among its ranking too).

The objective of C-E is the paper's mean loss, or the gap between the depths' mean losses (how
uneven positions are, which the paper's analysis of the positional channel motivates).

Stages C-E share the work of a prompt: the prompt prefix is run once with the unmodified
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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, Field, model_validator
from rich.progress import track
from scipy.signal import savgol_filter

from ragfix.backends.base import Backend
from ragfix.backends.channel_scaling.backend import (
    CandidateScore,
    ChannelScalingCalibration,
    SettingScore,
    StabilityCheck,
    apply_channel_scaling,
    scaled_keys,
)
from ragfix.backends.channel_scaling.options import default_layers
from ragfix.backends.hf import HFBackend
from ragfix.backends.patching import attention_modules
from ragfix.errors import ConfigError, RagfixError
from ragfix.models.load import model_identity
from ragfix.prompts import TaskPrompt
from ragfix.tasks import get_task
from ragfix.types import Passage

#: the factor candidates are ranked with (the official code's search setting)
SEARCH_FACTOR = 0.0
#: the paper's factor grid
DEFAULT_FACTORS = (0.5, 0.0, -0.5, -1.0)


class CalibrationError(RagfixError):
    """The calibration found nothing usable (the message says which sizes to raise)."""


class CalibrationSettings(BaseModel):
    """Sizes, data, seeds and objective of a calibration run.

    Attributes:
        samples: random-character prompts averaged in stage A (paper: 200).
        length: tokens per random-character prompt (paper: 1000).
        kv_examples: generated KV-retrieval calibration prompts (official default set: 60), half
            for tuning and half held out.
        kv_pairs: key-value pairs per KV calibration prompt (official set: 50); match the
            evaluation's so that the prompts are as long as the ones the setting is used on.
        qa_data: a Lost-in-the-Middle QA file for the QA half of the calibration set (the
            official ``KV50_NQ50`` set is half KV, half NQ); ``None``: KV prompts only.
        qa_records: the record range of ``qa_data`` read (``"START:END"``); keep it disjoint
            from the records the setting is reported on.
        qa_examples: QA calibration prompts (the first valid records of the range).
        qa_docs: passages per QA prompt (match the evaluation's).
        layers: decoder layers scaled during the search (default: the middle layers).
        factors: the factor grid of stage D.
        top_k: candidates ranked by loss (code: 10).
        objective: what the tune and held-out stages minimise: ``"loss"`` (the paper's mean
            teacher-forced answer loss) or ``"gap"`` (per task, the largest minus the smallest
            mean loss over the gold depths: how uneven the prompt positions are).
        finalists: tuned settings compared with the unmodified model on the held-out prompts.
        batch_size: prompts per forward in stage A.
        seed: seed of the random text and the KV prompts.
        stability_seed: a second random-text seed; stages A-B are repeated with it and the
            number of top-k channels both seeds share is recorded (``None``: not checked).

    Raises:
        pydantic.ValidationError: a size out of range, QA prompts without ``qa_data``.
    """

    samples: int = Field(ge=1)
    length: int = Field(ge=32)
    kv_examples: int = Field(ge=2)
    kv_pairs: int = Field(ge=2)
    qa_data: str | None = None
    qa_records: str = "0:"
    qa_examples: int = Field(default=0, ge=0)
    qa_docs: int = Field(default=10, ge=2)
    layers: list[int]
    factors: list[float] = Field(default_factory=lambda: list(DEFAULT_FACTORS), min_length=1)
    top_k: int = Field(default=10, ge=1)
    objective: Literal["loss", "gap"] = "loss"
    finalists: int = Field(default=3, ge=1)
    batch_size: int = Field(default=4, ge=1)
    seed: int = 0
    stability_seed: int | None = None

    @model_validator(mode="after")
    def _qa_half(self):
        if self.qa_examples and not self.qa_data:
            raise ValueError("qa_examples needs qa_data (a QA file)")
        if self.qa_data and self.qa_examples < 2:
            raise ValueError("qa_data needs qa_examples >= 2 (half are held out)")
        if self.stability_seed == self.seed:
            raise ValueError("stability_seed must differ from seed")
        return self

    @classmethod
    def for_backend(cls, backend: HFBackend, **overrides) -> CalibrationSettings:
        """Defaults scaled to the backend's model and device; ``overrides`` (not None) win.

        The prompt length is a quarter of the context window, at most the paper's 1000 tokens.
        On a GPU the paper's sizes are used (200 random-text prompts, 60 KV prompts of 50
        pairs); on a CPU 64 random-text prompts and 48 KV prompts of 8 pairs (the length of the
        KV-8 evaluation's prompts), so that SmolLM2-135M calibrates on two cores in minutes. With
        ``qa_data`` the QA half defaults to as many prompts as the KV half. The default layers
        are the middle ones of the model (:func:`~ragfix.backends.channel_scaling.default_layers`).

        Raises:
            pydantic.ValidationError: an override out of range.
        """
        gpu = backend.device.type == "cuda"
        base = {
            "samples": 200 if gpu else 64,
            "length": min(1000, backend.context_window // 4),
            "kv_examples": 60 if gpu else 48,
            "kv_pairs": 50 if gpu else 8,
            "layers": default_layers(backend.model.config.num_hidden_layers),
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        if base.get("qa_data") and "qa_examples" not in base:
            base["qa_examples"] = base["kv_examples"]
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
@dataclass(frozen=True)
class CalibrationPrompt:
    """One teacher-forced calibration prompt.

    Attributes:
        task: ``"kv"`` or ``"qa"``.
        depth: 0-based position of the gold pair / passage in the context.
        prompt_ids: the chat-formatted prompt, ending with the generation prompt (no answer
            prefix, as in the official calibration set).
        answer_ids: the bare gold answer's tokens.
    """

    task: str
    depth: int
    prompt_ids: list[int]
    answer_ids: list[int]


def _depths(n: int) -> list[int]:
    """The calibration depths for a context of ``n`` items: 1/4, 1/2 and 3/4 of it."""
    return [n // 4, n // 2, (3 * n) // 4]


def kv_calibration_examples(
    backend: Backend, examples: int, pairs: int, seed: int = 0
) -> list[CalibrationPrompt]:
    """Generated KV-retrieval calibration prompts (Lost-in-the-Middle KV template, random UUID
    keys and values), the gold pair at 1/4, 1/2 and 3/4 of the context in turn.

    As in the official calibration set (``valid_set/KV60_valid_set.json``), the answer is the bare
    value right after the generation prompt: the assistant turn is not prefilled.
    """
    rng = random.Random(seed)
    depths = _depths(pairs)
    out = []
    for i in range(examples):
        kv = [
            Passage(
                title=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                text=str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            )
            for _ in range(pairs)
        ]
        depth = depths[i % len(depths)]
        gold = kv[depth]
        prompt = TaskPrompt(user=get_task("kv").user_turn(gold.title, kv))
        out.append(
            CalibrationPrompt("kv", depth, backend.encode(prompt), backend.tokenize(gold.text))
        )
    return out


def qa_calibration_examples(
    backend: Backend, path: str | Path, records: str, examples: int, num_docs: int
) -> list[CalibrationPrompt]:
    """QA calibration prompts from a Lost-in-the-Middle QA file (the official set's NQ half):
    the first ``examples`` valid records of the range ``records`` (``"START:END"``, as
    ``ragfix eval --records``), ``num_docs`` passages each, the gold passage at 1/4, 1/2 and 3/4
    of the context in turn; the answer is the first gold answer, bare.

    Raises:
        ConfigError: a bad range, a KV file, or fewer valid records than ``examples``.
        DataError: an invalid record (file, line and field named).
    """
    from ragfix.connectors.litm import detect_format, load_samples

    if detect_format(path) != "qa":
        raise ConfigError(f"{path}: QA calibration needs a QA file (question, answers, ctxs)")
    samples = load_samples(path, num_docs, examples, records=records)
    if len(samples) < examples:
        raise ConfigError(
            f"{path}: records {records} hold {len(samples)} valid QA samples, {examples} wanted"
        )
    depths = _depths(num_docs)
    out = []
    for i, sample in enumerate(samples):
        depth = depths[i % len(depths)]
        prompt = get_task("qa").prompt(sample.question, sample.passages_with_gold_at(depth))
        out.append(
            CalibrationPrompt(
                "qa", depth, backend.encode(prompt), backend.tokenize(" " + sample.answers[0])
            )
        )
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


def prompt_losses(
    model,
    examples: list[CalibrationPrompt],
    layers: list[int],
    settings: list[tuple[int, float]],
    description: str = "calibration loss",
    progress: bool = True,
) -> np.ndarray:
    """:func:`example_losses` of every prompt.

    Returns:
        float64 array ``[len(examples), len(settings)]`` (nats per answer token).
    """
    rows = [
        example_losses(model, e.prompt_ids, e.answer_ids, layers, settings)
        for e in track(examples, description=description, disable=not progress)
    ]
    return np.asarray(rows, dtype=np.float64).reshape(len(examples), len(settings))


def score_setting(
    losses: np.ndarray, examples: list[CalibrationPrompt], channel: int | None, factor: float
) -> SettingScore:
    """The calibration scores of one setting from its per-prompt losses ``[len(examples)]``:
    the mean loss, the mean loss per ``task@depth`` and the gap (per task, the largest minus the
    smallest depth mean, averaged over the tasks)."""
    groups: dict[str, list[float]] = {}
    for e, loss in zip(examples, losses, strict=True):
        groups.setdefault(f"{e.task}@{e.depth}", []).append(float(loss))
    by_depth = {k: float(np.mean(v)) for k, v in sorted(groups.items())}
    spans = []
    for task in sorted({e.task for e in examples}):
        means = [v for k, v in by_depth.items() if k.startswith(task + "@")]
        spans.append(max(means) - min(means))
    return SettingScore(
        channel=channel,
        factor=factor,
        loss=float(np.mean(losses)),
        gap=float(np.mean(spans)),
        by_depth=by_depth,
    )


def _split(examples: list[CalibrationPrompt]) -> tuple[list, list]:
    """Tune and held-out halves: alternate prompts of each task, so both halves hold every task
    and depth (the depths cycle with period 3, the halves with period 2)."""
    tune, held = [], []
    for task in ("kv", "qa"):
        mine = [e for e in examples if e.task == task]
        tune += mine[0::2]
        held += mine[1::2]
    return tune, held


def screen(backend: HFBackend, settings: CalibrationSettings, seed: int, progress: bool = True):
    """Stages A and B with the random text of ``seed``: the ``top_k`` candidate channels."""
    ids = random_text_ids(backend, settings.samples, settings.length, seed)
    mean = mean_hidden_states(backend.model, ids, settings.batch_size, progress)[1:].numpy()
    return screen_channels(
        mean,
        mono_skip=round(0.3 * settings.length),
        smooth_skip=round(0.2 * settings.length),
        top_k=settings.top_k,
    )


def calibration_prompts(
    backend: HFBackend, settings: CalibrationSettings
) -> list[CalibrationPrompt]:
    """The KV prompts (generated with ``settings.seed``) and, with ``settings.qa_data``, the QA
    prompts of the calibration set."""
    out = kv_calibration_examples(backend, settings.kv_examples, settings.kv_pairs, settings.seed)
    if settings.qa_data:
        out += qa_calibration_examples(
            backend, settings.qa_data, settings.qa_records, settings.qa_examples, settings.qa_docs
        )
    return out


def select(heldout: list[SettingScore], best_tuned: SettingScore, objective: str) -> SettingScore:
    """Stage E: the held-out setting with the lowest ``objective``; when that is the unmodified
    model (``channel`` None), ``best_tuned``'s channel with factor 1, which changes nothing.

    Args:
        heldout: held-out scores, the unmodified model among them.
        best_tuned: the best setting on the tune prompts.
        objective: ``"loss"`` or ``"gap"``.
    """
    chosen = min(heldout, key=lambda s: getattr(s, objective))
    if chosen.channel is None:
        return chosen.model_copy(update={"channel": best_tuned.channel, "factor": 1.0})
    return chosen


def calibrate(
    backend: HFBackend, settings: CalibrationSettings, progress: bool = True
) -> ChannelScalingCalibration:
    """Find the positional channel, the layers and the factor for ``backend``'s model
    (stages A-D of the module docstring), then select on held-out prompts.

    The calibration prompts are split in two halves (:func:`_split`). The candidates (factor 0)
    and the best one's factor grid are scored on the tune half; the ``finalists`` best settings
    by ``settings.objective`` and the unmodified model are scored on the held-out half, and the
    best of those is chosen. When the unmodified model wins, the artefact says so
    (``beats_unmodified`` false) and holds factor 1, which leaves the model unchanged.

    Args:
        backend: an unmodified Hugging Face backend (``vanilla``) of the model to calibrate;
            stages A, C and D run its model directly (the method's internals).
        settings: sizes, layers, factor grid, objective (see
            :meth:`CalibrationSettings.for_backend`).
        progress: show a progress bar per stage.

    Returns:
        the artefact (not yet saved).

    Raises:
        CalibrationError: no channel passes the monotonicity screen.
        ConfigError: unsupported architecture, layers out of range, a bad QA file or range.
    """
    start = time.perf_counter()
    model = backend.model
    n_layers = model.config.num_hidden_layers
    if any(not 0 <= i < n_layers for i in settings.layers):
        raise ConfigError(f"layers {settings.layers}: out of range 0..{n_layers - 1}")
    examples = calibration_prompts(backend, settings)  # a bad QA file fails before any work
    candidates = screen(backend, settings, settings.seed, progress)
    if not candidates:
        raise CalibrationError(
            "no hidden-state channel is monotone in position in more than a quarter of the "
            "layers; raise --samples or --length"
        )
    stability = None
    if settings.stability_seed is not None:
        other = screen(backend, settings, settings.stability_seed, progress)
        shared = {c.channel for c in candidates} & {c.channel for c in other}
        stability = StabilityCheck(
            seeds=[settings.seed, settings.stability_seed],
            top_k=settings.top_k,
            shared=len(shared),
            other_candidates=[c.channel for c in other],
        )
    tune, held = _split(examples)
    key = settings.objective

    ranking = [(0, 1.0)] + [(c.channel, SEARCH_FACTOR) for c in candidates]
    losses = prompt_losses(model, tune, settings.layers, ranking, "ranking candidates", progress)
    unmodified = score_setting(losses[:, 0], tune, None, 1.0)
    scored = []
    for j, cand in enumerate(candidates, start=1):
        s = score_setting(losses[:, j], tune, cand.channel, SEARCH_FACTOR)
        cand.loss, cand.gap = s.loss, s.gap
        scored.append(s)
    best = min(scored, key=lambda s: getattr(s, key))
    rest = [f for f in settings.factors if f != SEARCH_FACTOR]
    if rest:
        grid = [(best.channel, f) for f in rest]
        g = prompt_losses(model, tune, settings.layers, grid, "factor grid", progress)
        scored += [score_setting(g[:, j], tune, c, f) for j, (c, f) in enumerate(grid)]
    scored.sort(key=lambda s: getattr(s, key))
    finalists = scored[: settings.finalists]

    final = [(0, 1.0)] + [(s.channel, s.factor) for s in finalists]
    h = prompt_losses(model, held, settings.layers, final, "held-out selection", progress)
    heldout = [  # column 0: the unmodified model
        score_setting(h[:, j], held, c if j else None, f) for j, (c, f) in enumerate(final)
    ]
    chosen = select(heldout, finalists[0], key)
    by_factor = {s.factor: s.loss for s in scored if s.channel == best.channel}
    return ChannelScalingCalibration(
        model=model_identity(model),
        channel=chosen.channel,
        layers=settings.layers,
        factor=chosen.factor,
        baseline_loss=unmodified.loss,
        factor_losses={str(f): by_factor[f] for f in settings.factors},
        candidates=candidates,
        settings=settings.model_dump(mode="json"),
        minutes=(time.perf_counter() - start) / 60,
        objective=key,
        beats_unmodified=chosen.factor != 1.0,  # scaling by 1 changes nothing
        tune=[unmodified, *scored],
        heldout=heldout,
        stability=stability,
        prompts={"tune": len(tune), "heldout": len(held)},
    )


def calibration_table(cal: ChannelScalingCalibration):
    """The calibration as one table (:class:`~ragfix.tables.TableSpec`): the unmodified
    model, every candidate at the search factor and the best candidate's factor grid, each with
    its tune and (for the finalists) held-out loss and gap; the chosen setting marked. Its
    lines give the prompts, the stability check and the choice. ``ragfix calibrate --table``
    writes it as a result file that ``ragfix render`` turns into Markdown (kind ``benchmark``).
    """
    from ragfix.tables import TableSpec

    def name(s: SettingScore) -> str:
        return "unmodified" if s.channel is None else f"channel {s.channel} x {s.factor:g}"

    held = {(s.channel, s.factor): s for s in cal.heldout}
    chosen = (cal.channel, cal.factor) if cal.beats_unmodified else (None, 1.0)
    rows = []
    for s in cal.tune:
        h = held.get((s.channel, s.factor))
        cells = [name(s), f"{s.loss:.4f}", f"{s.gap:.4f}"]
        cells += [f"{h.loss:.4f}", f"{h.gap:.4f}"] if h else ["", ""]
        if (s.channel, s.factor) == chosen:
            cells[0] += " (chosen)"
        rows.append(cells)
    st = cal.settings
    qa = (
        f" and {st['qa_examples']} QA prompts of {st['qa_docs']} passages (records "
        f"{st['qa_records']} of `{Path(st['qa_data']).name}`)"
        if st.get("qa_data")
        else ""
    )
    lines = [
        f"{st['samples']} random-text prompts of {st['length']} tokens; {st['kv_examples']} KV "
        f"prompts of {st['kv_pairs']} pairs{qa}; half of each tuned on, half held out; layers "
        f"{cal.layers[0]}-{cal.layers[-1]}; losses in nats per answer token; gap = largest minus "
        "smallest mean loss over the gold depths."
    ]
    if cal.stability:
        lines.append(
            f"Stability: the random texts of seeds {cal.stability.seeds[0]} and "
            f"{cal.stability.seeds[1]} share {cal.stability.shared} of their "
            f"{cal.stability.top_k} candidate channels."
        )
    if cal.beats_unmodified:
        verdict = f"chosen on the held-out prompts by {cal.objective}: {name(held[chosen])}."
    else:
        verdict = (
            f"no scaled setting beats the unmodified model on the held-out prompts by "
            f"{cal.objective}: the file keeps the model unchanged (factor 1)."
        )
    lines.append(verdict[0].upper() + verdict[1:])
    title = f"channel-scaling calibration of {cal.model.get('name')} (objective: {cal.objective})"
    headers = ["setting", "tune loss", "tune gap", "held-out loss", "held-out gap"]
    return TableSpec(title, headers, rows, lines)
