"""Found in the Middle: the attention to each passage calibrated against its positional bias.

Hsieh et al., "Found in the Middle: Calibrating Positional Attention Bias Improves Long Context
Utilization" (arXiv 2406.16008, ACL Findings 2024), Sec. 3.2 and 4.1, Appendix B. The attention a
passage receives is modelled as its relevance plus a bias that depends only on its slot
(Eq. 2); the bias is measured with content-free passages in the same slots (Eq. 3) and
subtracted, and the attention mass on the passages is redistributed by the softmax of what is
left (Eq. 5-6). There is no official code; this module computes the attention itself inside a
patched forward of every attention module.

For a task prompt with ``n`` passages (:attr:`TaskPrompt.passages`, found among the tokens by
:func:`~ragfix.backends.passages.passage_tokens`: a token belongs to the piece of text its
first character is in):

* **readers**: every query after the last passage (the question, the end of the user turn, the
  assistant prefix), every generated token and every token of a scored continuation. The other
  query rows (the text before and inside the passages) attend as the model does.
* **layers** (option ``layers``): ``upper`` = layers ``L // 2 .. L - 1`` (the paper calibrates
  the last 16 of 32), or ``all``. The other layers attend as the model does. In a
  sliding-window layer a reader is calibrated only when the window holds every passage token
  (its index minus the first passage token's is under ``window``); a reader that cannot see
  some passage (or part of one) attends there as the model does, since neither its attention
  to that passage nor the bias measured where the slot was in view says what the passage is
  worth (Gemma 3's local layers at 10 SQuAD paragraphs, Mistral's window).
* In a calibrated layer, for every head and reader row with attention probabilities ``a`` over
  the keys (softmax in float32): per passage ``k`` of ``len_k`` tokens, ``mass_k = sum_{t in k}
  a_t`` and ``mean_k = mass_k / len_k``; the relevance is ``r_k = mean_k - b_k``; the passages'
  total ``M = sum_k mass_k`` is kept and redistributed, ``new_k = M * softmax(r / t)_k``
  (``t``: option ``temperature``, the paper's ``5e-5`` by default; with ``heads="mean"`` the
  relevance is averaged over the layer's heads first); each token of passage ``k``
  gets ``a_t * new_k / mass_k``; keys outside the passages keep their probabilities. The output
  is these probabilities times the values.
* **bias** ``b_k`` (per layer, head and slot ``k``): ``mean_k`` measured on
  :attr:`TaskPrompt.no_content` (the same template with every passage content-free and the
  content-free query ``N/A``) with the model's own attention, averaged over that prompt's
  readers. It depends only on the template and the number of passages, so it is kept per
  backend, keyed by the content-free prompt's chat text: a sweep measures it once per number
  of passages.

Choices the paper leaves open, made here: which query rows are calibrated (the readers above,
the same readers in the content-free prompt); the per-token mean as the attention of a passage
(so that passages of other lengths than their content-free stand-ins compare); the bias per
head (not averaged over heads) and measured with uncalibrated attention, on one content-free
prompt (the paper's "dummy document" in every slot at once, rather than one dummy per slot); a
passage no reader attends to at all (every probability underflows to 0, or no token starts
inside it) is left out of the softmax and keeps nothing, so ``M`` is kept exactly.

Batched with left padding, decoding over the run's own cache of rotated keys and values; the
layers left alone, and in a calibrated layer the rows before the batch's first reader, run
through ``scaled_dot_product_attention``, the rest with explicit probabilities. Every family
through :mod:`ragfix.backends.family`: the module's own projections and q/k norms, the
decoder's ``position_embeddings`` for the layer and the family's ``apply_rotary_pos_emb`` (a RoPE
variant composes), the module's ``scaling``; a sliding-window layer's queries see only the last
``window`` tokens before them. An adapter composes (merged into the weights before). Refuses, in
one line: a family whose attention logits are soft-capped (before any weights are loaded), a
prompt without passage spans or without its content-free form, and a model whose attention
another method already patches. No prefix reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ragfix.backends.base import BackendOptions, Prompt
from ragfix.backends.calibrated_attention.options import CalibratedAttentionOptions
from ragfix.backends.family import (
    Family,
    apply_rotary,
    layer_window,
    project_qkv,
    window_band,
)
from ragfix.backends.hf import chat_text
from ragfix.backends.layout import LayoutBackend
from ragfix.backends.passages import OUTSIDE, PAD, passage_tokens, spans_required
from ragfix.backends.patching import attention_modules, routed
from ragfix.errors import RagfixError
from ragfix.prompts import TaskPrompt

#: bias tables kept per backend (one per template and number of passages)
_BIAS_CACHE = 64


@dataclass(frozen=True)
class ReaderLayout:
    """A task prompt as the calibrated attention reads it.

    Attributes:
        ids: the tokens the model reads (the vanilla encoding of the prompt).
        blocks: per token the index of its passage, or :data:`~ragfix.backends.passages.OUTSIDE`.
        first: the index of the first reader (the first token after the last passage).
        prompt: the task prompt (its :attr:`TaskPrompt.no_content` gives the bias).
    """

    ids: list[int]
    blocks: list[int]
    first: int
    prompt: TaskPrompt


class _CalibratedRun:
    """State of one prefill/decode run over a left-padded batch of layouts: per token its
    passage (``blocks``), whether it reads (``reader``) and its position; per layer the rotated
    keys and values; per calibrated layer the bias of every row's slots. In measuring mode
    (``biases=None``) nothing is calibrated and the readers' per-token mean attention per
    passage, averaged over the readers, is recorded per calibrated layer (``measured``)."""

    def __init__(
        self,
        backend: CalibratedAttentionBackend,
        layouts: Sequence[ReaderLayout],
        extra: Sequence[Sequence[int]] = (),
        biases: Sequence[dict[int, torch.Tensor]] | None = None,
    ):
        dev = backend.device
        extra = list(extra) or [[] for _ in layouts]
        rows = [
            ([*lay.ids, *more], [*lay.blocks, *[OUTSIDE] * len(more)], lay.first)
            for lay, more in zip(layouts, extra, strict=True)
        ]
        width = max(len(r[0]) for r in rows)
        pads = [width - len(r[0]) for r in rows]
        pad_id = backend.tokenizer.pad_token_id
        self.ids = torch.tensor([[pad_id] * p + r[0] for p, r in zip(pads, rows, strict=True)])
        self.ids = self.ids.to(dev)
        blocks = torch.tensor([[PAD] * p + r[1] for p, r in zip(pads, rows, strict=True)])
        self.blocks = blocks.to(dev)  # [B, T]
        index = torch.arange(width, device=dev)[None]
        pad = torch.tensor(pads, device=dev)[:, None]
        first = torch.tensor([r[2] for r in rows], device=dev)[:, None]
        self.reader = (index - pad >= first) & (self.blocks != PAD)  # [B, T]
        inside = self.blocks >= 0
        #: per row the index of its first passage token (past the row's end when it has none)
        self.first_passage = torch.where(inside.any(1), inside.int().argmax(1), width)[:, None]
        self.positions = (index - pad).clamp(min=0)  # [B, T]
        self.n = max(len(lay.prompt.passages) for lay in layouts)
        self.onehot = self._onehot(self.blocks)  # [B, T, n] float32
        self.lengths = self.onehot.sum(1)  # [B, n]
        self.layers = backend.layers
        self.temperature = backend.options.temperature
        self.heads = backend.options.heads
        self.measure = biases is None
        self.measured: dict[int, torch.Tensor] = {}
        self.bias: dict[int, torch.Tensor] = {}
        if biases is not None:
            for layer in self.layers:
                table = torch.zeros(len(layouts), biases[0][layer].shape[0], self.n, device=dev)
                for b, bias in enumerate(biases):
                    table[b, :, : bias[layer].shape[1]] = bias[layer]
                self.bias[layer] = table  # [B, H, n]
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _onehot(self, blocks: torch.Tensor) -> torch.Tensor:
        slots = torch.arange(self.n, device=blocks.device)
        return (blocks[..., None] == slots).float()

    def grow(self, c: int) -> None:
        """Add ``c`` generated tokens: readers outside the passages, positions after each row's
        last."""
        b, dev = self.blocks.shape[0], self.blocks.device
        steps = torch.arange(1, c + 1, device=dev)[None]
        self.positions = torch.cat([self.positions, self.positions[:, -1:] + steps], dim=1)
        more = torch.full((b, c), OUTSIDE, device=dev, dtype=self.blocks.dtype)
        self.blocks = torch.cat([self.blocks, more], dim=1)
        self.reader = torch.cat([self.reader, torch.ones_like(more, dtype=torch.bool)], dim=1)
        self.onehot = torch.cat([self.onehot, self._onehot(more)], dim=1)

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The step's attention over every cached key (see the module docstring).

        Args:
            attn: the layer's attention module (``scaling``, ``layer_idx``).
            q: rotated queries ``[B, H, c, d]``; k, v: the step's rotated keys / values
                ``[B, Hkv, c, d]``, appended to the layer's cache.

        Returns:
            ``[B, c, H * d]`` attention output (before ``o_proj``).
        """
        layer = attn.layer_idx
        if layer in self.cache:
            old_k, old_v = self.cache[layer]
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.cache[layer] = (k, v)
        bsz, heads, c, d = q.shape
        total = k.shape[2]
        start = total - c
        groups = heads // k.shape[1]
        keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        qi = torch.arange(start, total, device=q.device)[None, :, None]
        ki = torch.arange(total, device=q.device)[None, None, :]
        blocks = self.blocks[:, :total]
        seen = (ki <= qi) & (blocks[:, None, :] != PAD) & window_band(qi, ki, layer_window(attn))
        seen |= (ki == qi) & (blocks[:, start:, None] == PAD)  # a padding query sees itself
        readers = self.reader[:, start:total]  # [B, c]
        split = c
        if layer in self.layers:
            cols = readers.any(0).nonzero()
            split = int(cols[0]) if len(cols) else c
            # a reader is calibrated only where its window holds the first passage token
            readers = readers & window_band(
                qi[0, :, 0][None], self.first_passage, layer_window(attn)
            )
        out = torch.empty(bsz, heads, c, d, device=q.device, dtype=q.dtype)
        if split:
            out[:, :, :split] = F.scaled_dot_product_attention(
                q[:, :, :split], keys, values, attn_mask=seen[:, None, :split], scale=attn.scaling
            )
        if split < c:
            logits = (q[:, :, split:] @ keys.transpose(-1, -2)) * attn.scaling
            logits = logits.masked_fill(~seen[:, None, split:], float("-inf"))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            rows = readers[:, split:]
            if self.measure:
                self._record(layer, probs, rows)
            else:
                probs = self.calibrate(layer, probs, rows)
            out[:, :, split:] = probs.to(values.dtype) @ values
        return out.transpose(1, 2).reshape(bsz, c, heads * d)

    def _record(self, layer: int, probs: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep the readers' mean over rows of ``mass_k / len_k``, ``[B, H, n]`` -> row 0's
        ``[H, n]`` (a measuring run holds one prompt)."""
        onehot = self.onehot[:, : probs.shape[-1]]
        mean = (probs @ onehot[:, None]) / self.lengths.clamp(min=1)[:, None, None]
        w = rows.float()[:, None, :, None]  # [B, 1, r, 1]
        self.measured[layer] = ((mean * w).sum(2) / w.sum(2))[0]

    def calibrate(self, layer: int, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The calibrated probabilities of the reader rows (the others as they are).

        Args:
            layer: a calibrated layer.
            probs: float32 ``[B, H, r, T]`` attention probabilities of ``r`` query rows.
            rows: ``[B, r]`` whether each row is a reader.

        Returns:
            float32 ``[B, H, r, T]``: in a reader row, passage ``k``'s tokens rescaled by
            ``new_k / mass_k`` (module docstring); every other probability unchanged.
        """
        onehot = self.onehot[:, : probs.shape[-1]]  # [B, T, n]
        mass = probs @ onehot[:, None]  # [B, H, r, n]
        rel = mass / self.lengths.clamp(min=1)[:, None, None] - self.bias[layer][:, :, None]
        if self.heads == "mean":
            rel = rel.mean(dim=1, keepdim=True).expand_as(rel)
        kept = (mass > 0) & (self.lengths > 0)[:, None, None]
        alpha = torch.softmax((rel / self.temperature).masked_fill(~kept, float("-inf")), dim=-1)
        total = mass.sum(-1, keepdim=True)
        ratio = torch.where(kept, total * alpha / mass.clamp(min=torch.finfo(mass.dtype).tiny), 0)
        inside = onehot.sum(-1)  # [B, T]: 1 for a passage token
        scale = ratio @ onehot.transpose(1, 2)[:, None] + (1 - inside)[:, None, None]
        apply = rows[:, None, :, None] & (total > 0)
        return torch.where(apply, probs * scale, probs)


def _calibrated_attention_forward(
    attn, run: _CalibratedRun, hidden_states, position_embeddings=None, *args, **kwargs
):
    """Replacement ``forward`` of an attention module during a run: projects q/k/v as the family
    does (:func:`~ragfix.backends.family.project_qkv`), rotates them with the decoder's
    ``position_embeddings`` and attends as :meth:`_CalibratedRun.attend` does over ``run``'s
    cache. Returns ``(output [B, c, hidden], None)``."""
    q, k, v = project_qkv(attn, hidden_states)
    cos, sin = position_embeddings
    q, k = apply_rotary(attn)(q, k, cos, sin)
    return attn.o_proj(run.attend(attn, q, k, v)), None


class CalibratedAttentionBackend(LayoutBackend):
    """The ``calibrated-attention`` backend (see the module docstring). Composes with an
    adapter (merged into the weights before the attention is patched).

    Args:
        model, tokenizer, adapter: as for :class:`~ragfix.backends.hf.HFBackend`.
        **options: :class:`CalibratedAttentionOptions`.

    Attributes:
        layers: the indices of the calibrated layers.

    Raises:
        pydantic.ValidationError: an invalid option (``temperature <= 0``).
        UnsupportedModelError: a family with soft-capped attention logits.
    """

    name: ClassVar[str] = "calibrated-attention"
    options_model: ClassVar[type[BackendOptions]] = CalibratedAttentionOptions
    needs_passage_spans = True
    sliding_rule = "a sliding layer calibrates the readers whose window holds every passage"

    @classmethod
    def check_family(cls, family: Family, options: BackendOptions) -> None:
        """The calibration rescales plain softmax probabilities.

        Raises:
            UnsupportedModelError: soft-capped attention logits.
        """
        if family.softcap:
            raise family.refuse("calibrated-attention", "its attention logits are soft-capped")

    def __init__(self, model, tokenizer, *, adapter: dict | None = None, **options):
        super().__init__(model, tokenizer, adapter=adapter, **options)
        self.attentions = attention_modules(model)
        count = len(self.attentions)
        self.layers = frozenset(range(count // 2 if self.options.layers == "upper" else 0, count))
        self._biases: dict[str, dict[int, torch.Tensor]] = {}

    def _content_free(self, prompt: Prompt) -> TaskPrompt:
        """The content-free form of ``prompt`` (:attr:`TaskPrompt.no_content`).

        A closed-book prompt (:attr:`TaskPrompt.closed_book`) is its own: it has no passage.

        Raises:
            RagfixError: a prompt without passage spans, or without a content-free form with
                as many passages (built by the task prompts of :mod:`ragfix.tasks`).
        """
        prompt = spans_required(self, prompt, "calibrates the attention to a prompt's passages")
        if prompt.closed_book:
            return prompt
        free = prompt.no_content
        if free is None or len(free.passages) != len(prompt.passages):
            raise RagfixError(
                f"backend {self.name!r} needs the prompt's content-free form with as many "
                "passages (TaskPrompt.no_content, built by the task prompts of ragfix.tasks)"
            )
        return free

    def _layout(self, prompt: Prompt) -> ReaderLayout:
        """The tokens of ``prompt`` (its vanilla encoding), their passages and its first reader.

        Raises:
            RagfixError: as :meth:`_content_free`; a tokenizer without offsets.
        """
        self._content_free(prompt)
        ids, blocks, first = passage_tokens(self, prompt)
        return ReaderLayout(ids, blocks, first, prompt)

    def positional_bias(self, prompt: TaskPrompt) -> dict[int, torch.Tensor]:
        """The positional bias of ``prompt``'s passage slots, measured on its content-free form
        (:attr:`TaskPrompt.no_content`) and kept by that form's chat text.

        Returns:
            per calibrated layer, float32 ``[H, n]`` on the model's device: per head and slot,
            the per-token mean attention probability the content-free prompt's readers pay the
            slot's passage, averaged over the readers.

        Raises:
            RagfixError: as :meth:`_content_free`; a content-free prompt without text after
                its passages.
            IncompatibleMethodsError: another method already patches the attention.

        A closed-book prompt has no slot (``[H, 0]`` per layer): its attention is the model's.
        """
        free = self._content_free(prompt)
        if free.closed_book:
            heads = self.model.config.get_text_config().num_attention_heads
            return {layer: torch.zeros(heads, 0, device=self.device) for layer in self.layers}
        key = chat_text(self.tokenizer, free)
        if key not in self._biases:
            if len(self._biases) >= _BIAS_CACHE:
                self._biases.pop(next(iter(self._biases)))
            self._biases[key] = self._measure_bias(free)
        return self._biases[key]

    @torch.no_grad()
    def _measure_bias(self, free: TaskPrompt) -> dict[int, torch.Tensor]:
        """One uncalibrated pass over the content-free prompt ``free``, recording the readers'
        attention per calibrated layer (see :meth:`positional_bias`)."""
        ids, blocks, first = passage_tokens(self, free)
        if first == len(ids):
            raise RagfixError(
                "calibrated-attention measures the positional bias with the text after the "
                "passages and the content-free prompt has none"
            )
        run = _CalibratedRun(self, [ReaderLayout(ids, blocks, first, free)])
        with self._patched(run):
            self.model(
                input_ids=run.ids, position_ids=run.positions, use_cache=False, logits_to_keep=1
            )
        return run.measured

    def _patched(self, run: _CalibratedRun):
        """Route every attention module through the calibrated attention while ``run`` steps
        (:func:`~ragfix.backends.patching.routed`).

        Raises:
            IncompatibleMethodsError: another method already patches the attention.
        """
        return routed(self.name, self.attentions, _calibrated_attention_forward, run)

    @torch.no_grad()
    def _forward(
        self, layouts: Sequence[ReaderLayout], extra: Sequence[Sequence[int]] = (), keep: int = 1
    ):
        """The calibrated prefill of ``layouts`` (each followed by its ``extra`` tokens, readers)
        and its cached decoding step.

        Args:
            keep: logits of the last ``keep`` positions (0: all).

        Returns:
            ``(logits [B, keep or T, vocab], step)``: ``step`` takes ``[B, 1]`` next token ids
            (readers) to ``[B, 1, vocab]`` logits over the run's cache.

        Raises:
            IncompatibleMethodsError: another method already patches the attention.
        """
        biases = [self.positional_bias(lay.prompt) for lay in layouts]
        run = _CalibratedRun(self, layouts, extra, biases)
        with self._patched(run):
            logits = self.model(
                input_ids=run.ids,
                position_ids=run.positions,
                use_cache=False,
                logits_to_keep=keep,
            ).logits

        @torch.no_grad()
        def step(nxt: torch.Tensor) -> torch.Tensor:
            run.grow(nxt.shape[1])
            with self._patched(run):
                return self.model(
                    input_ids=nxt, position_ids=run.positions[:, -nxt.shape[1] :], use_cache=False
                ).logits

        return logits, step

    def _run(self, layouts: Sequence[ReaderLayout], extra: Sequence[Sequence[int]] = ()):
        """See :meth:`~ragfix.backends.layout.LayoutBackend._run`: the logits of the last
        ``1 + max(len(extra))`` positions of the calibrated prefill (:meth:`_forward`)."""
        return self._forward(layouts, extra, keep=1 + max((len(e) for e in extra), default=0))


__all__ = ["CalibratedAttentionBackend", "ReaderLayout"]
