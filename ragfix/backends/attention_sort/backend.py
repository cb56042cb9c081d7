"""Attention sorting of a task prompt's passages, calibrated or not, before the model answers.

The ``attention-sort`` backend reads a task prompt once, scores each passage by the attention
the text after the passages (the question, the end of the user turn, the assistant prefix) pays
it, moves the passages so that the most attended one is where the model reads best (``place``:
last, next to the question, as the paper does; or first), and answers the reordered prompt with
the model's own attention. A passage moves with its label.

* Sorting by attention: Peysakhovich & Lerer, "Attention Sorting Combats Recency Bias In Long
  Context Language Models" (arXiv 2310.01427, Sec. 3): ascending by attention, a few rounds.
* Readers and calibration: Chen et al., "Attention in Large Language Models Yields Efficient
  Zero-Shot Re-Rankers" (in-context re-ranking, ICR; arXiv 2410.02642, Sec. 3): the attention
  comes from the query's tokens (not the last token only), and with ``calibrate`` the attention
  the same passages get from the content-free query ``N/A`` (:attr:`TaskPrompt.no_query`) is
  subtracted, removing what a passage receives for where it stands rather than what it says.
* Layers: Hsieh et al., "Found in the Middle" (arXiv 2406.16008, Sec. 4) calibrate the upper
  half of the layers; ``layers="upper"`` averages the scores there, ``"all"`` over every layer.

Score of passage ``d`` in layer ``l`` (:func:`passage_attention`): the attention probability the
readers give ``d``'s tokens, summed over the tokens, averaged over heads and readers (a mean,
so that the question and the content-free query, of other lengths, are comparable).

Sliding-window layers (Gemma 3's local layers, Mistral's window): a layer is read only when
its window holds every passage token for every reader. A layer whose readers cannot see the
first passages pays them nothing for where they stand, not for what they say; averaged in,
it would rank the passages inside its window above the others (Gemma 3 270M: 15 of its 18
layers have a 512-token window, and at 10 SQuAD paragraphs none of them sees the first
passages). :func:`passage_attention` marks such a layer's row ``NaN`` and
:func:`combine_scores` averages over the selected layers that see every passage. A prompt that
no layer sees whole (every layer slides a window shorter than the prompt from its first passage
on) is refused in one line, before any attention pass.

Refuses a prompt without passage spans (a framework's or a client's text) in one line, and
declares it (:attr:`~ragfix.backends.base.Backend.needs_passage_spans`), so that a consumer whose
prompts never carry any (``ragfix serve``, the framework components) refuses the backend at
start. A prompt that does not fit the window is flagged by :meth:`AttentionSortBackend.fit` on
its tokens as given, before any attention pass. Prefix reuse is exact (the reordered prompt is
read with vanilla attention), and an adapter composes.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ragfix.backends.attention_sort.options import AttentionSortOptions, with_place
from ragfix.backends.base import BackendOptions, Fit, Prompt, answer_rules
from ragfix.backends.family import full_cache, model_family, window_band
from ragfix.backends.hf import HFBackend, chat_text
from ragfix.backends.passages import OUTSIDE, passage_tokens, spans_required
from ragfix.errors import RagfixError
from ragfix.prompts import TaskPrompt

#: sorted prompts kept per backend (the sweep's fit check and its generation read the same one)
_SORTED_CACHE = 256


#: what the backend does with the passages (its refusal of a prompt without spans)
SORTS = "sorts a prompt's passages"


def whole_view(backend: HFBackend, ids: list[int], blocks: list[int]) -> torch.Tensor:
    """Per layer, whether its window holds every passage token for every reader of a prompt's
    tokens ``ids`` (``blocks``: each token's passage, as
    :func:`~ragfix.backends.passages.passage_tokens` gives them): a full layer, or a sliding one
    whose window exceeds the last token's index minus the first passage token's. ``[layers]``
    bool.

    Raises:
        UnsupportedModelError: no layer does (every layer slides a window shorter than the
            prompt from its first passage on): attention cannot score the first passages.
    """
    family = model_family(backend.model)
    last = torch.tensor(len(ids) - 1)
    first = torch.tensor(min(t for t, j in enumerate(blocks) if j != OUTSIDE))
    sees = torch.stack([window_band(last, first, w) for w in family.windows])
    if not sees.any():
        raise family.refuse(
            "attention-sort",
            f"every layer's sliding window (at most {max(family.windows)} tokens) is shorter than "
            f"the prompt from its first passage on ({int(last - first) + 1} tokens)",
        )
    return sees


@torch.no_grad()
def passage_attention(
    backend: HFBackend, prompt: TaskPrompt, shared: dict | None = None
) -> torch.Tensor:
    """Per layer, the attention each passage of ``prompt`` receives from the readers.

    The readers are the tokens after the last passage (a token belongs to the piece of text its
    first character is in). The text before them is prefilled with the model's own attention
    kernel; the readers run with eager attention to read their weights.

    Args:
        shared: a dict the calls of one sort share (empty at first): a call whose tokens before
            the readers are those of the call before reads that call's prefilled KV cache,
            cropped back to them, instead of prefilling them again (the query and the
            content-free query of one prompt: the same passages, other readers); ``None``:
            every call prefills its own.

    Returns:
        float32 ``[layers, n]`` on the CPU: the attention probability the readers pay each
        passage's tokens, summed over the tokens, averaged over heads and readers (0..1);
        ``NaN`` in the row of a sliding-window layer whose window leaves a passage token out
        of some reader's view (the last reader's index minus the first passage token's is
        ``window`` or more).

    Raises:
        RagfixError: a backend without local weights (a remote model), a prompt without
            passage spans, a tokenizer without offsets, or a model whose attention returns no
            weights.
        UnsupportedModelError: no layer sees every passage (:func:`whole_view`).
    """
    if not isinstance(backend, HFBackend):
        raise RagfixError(
            f"backend {backend.name!r} exposes no attention weights; attention-sort needs a "
            "local model"
        )
    prompt = spans_required(backend, prompt, SORTS)
    ids, blocks, first = passage_tokens(backend, prompt)
    member = torch.zeros(len(ids), len(prompt.passages))
    for t, j in enumerate(blocks):
        if j != OUTSIDE:
            member[t, j] = 1.0
    if first == len(ids) or first == 0:
        raise RagfixError("attention-sort needs text after the passages (the question) to read")
    sees = whole_view(backend, ids, blocks)
    model, dev = backend.model, backend.device
    if shared and shared["ids"] == ids[:first]:
        cache = shared["cache"]
        cache.crop(first - cache.get_seq_length())  # the readers of the call before go
    else:
        cache = full_cache()  # every key of every layer: a sliding layer's weights cover them all
        model(input_ids=torch.tensor([ids[:first]], device=dev), cache=cache, logits_to_keep=1)
        if shared is not None:
            shared.update(ids=ids[:first], cache=cache)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(
            input_ids=torch.tensor([ids[first:]], device=dev),
            cache=cache,
            output_attentions=True,
            logits_to_keep=1,
        )
    finally:
        model.set_attn_implementation(before)
    if not out.attentions or out.attentions[0] is None:
        raise RagfixError(f"backend {backend.name!r} exposes no attention weights")
    att = torch.stack([a[0].float().cpu() for a in out.attentions])  # [L, H, R, T]
    scores = (att @ member).mean(dim=(1, 2))
    scores[~sees] = float("nan")
    return scores


def combine_scores(
    att: torch.Tensor, att_free: torch.Tensor | None, options: AttentionSortOptions
) -> torch.Tensor:
    """The score per passage under ``options`` from the readings ``[layers, n]`` of a prompt
    (``att``) and of its content-free-query form (``att_free``, read only with ``calibrate``):
    ``att - att_free`` with ``calibrate``, averaged over the selected layers (``upper``:
    ``L // 2`` on) that see every passage (the rows :func:`passage_attention` leaves finite);
    ``[n]``.

    Raises:
        RagfixError: no selected layer sees every passage (each one's sliding window is
            shorter than the prompt from its first passage on).
    """
    x = att - att_free if options.calibrate else att
    first = x.shape[0] // 2 if options.layers == "upper" else 0
    x = x[first:]
    seeing = ~x.isnan().any(dim=1)
    if not seeing.any():
        raise RagfixError(
            f"attention-sort layers={options.layers}: none of these layers sees every passage "
            "(their sliding windows are shorter than the prompt from its first passage on); "
            "try layers=all"
        )
    return x[seeing].mean(dim=0)


def calibrated_attention(
    backend: HFBackend, prompt: TaskPrompt
) -> tuple[torch.Tensor, torch.Tensor]:
    """The :func:`passage_attention` of ``prompt`` and of its content-free-query form
    (:attr:`TaskPrompt.no_query`), over one prefill of the passages: the second read takes the
    KV cache the first prefilled. Two ``[layers, n]`` tensors.

    Raises:
        RagfixError: as :func:`passage_attention`; a prompt without
            :attr:`TaskPrompt.no_query`.
    """
    if prompt.no_query is None:
        raise RagfixError(
            "attention-sort calibrate=true needs the prompt's content-free query form "
            "(TaskPrompt.no_query, built by the task prompts of ragfix.tasks)"
        )
    shared: dict = {}
    att = passage_attention(backend, prompt, shared)
    return att, passage_attention(backend, prompt.no_query, shared)


def passage_scores(backend: HFBackend, prompt: TaskPrompt, options: AttentionSortOptions):
    """One score per passage of ``prompt`` under ``options`` (higher = more attended,
    :func:`combine_scores` of the :func:`passage_attention` of ``prompt`` or, with
    ``calibrate``, of :func:`calibrated_attention`).

    Raises:
        RagfixError: as :func:`passage_attention` and :func:`calibrated_attention`.
    """
    if not options.calibrate:
        return combine_scores(passage_attention(backend, prompt), None, options)
    return combine_scores(*calibrated_attention(backend, prompt), options)


def sort_passages(
    backend: HFBackend, prompt: TaskPrompt, options: AttentionSortOptions
) -> tuple[list[int], list[list[float]]]:
    """Attention sorting of ``prompt``'s passages (see the module docstring).

    Returns:
        ``(order, history)``: ``order[j]`` is the index (in ``prompt``) of the passage put at
        position ``j`` (ascending score, stable: the most attended last; with ``place`` first,
        descending, stable: the most attended first); ``history`` holds each round's score per
        passage index (``rounds`` lists). One passage: no model call.

    Raises:
        RagfixError: as :func:`passage_scores`.
    """
    prompt = spans_required(backend, prompt, SORTS)
    first = with_place(options, backend.model_name).place == "first"
    order = list(range(len(prompt.passages)))
    history: list[list[float]] = []
    if len(order) < 2:
        return order, history
    for _ in range(options.rounds):
        scores = passage_scores(backend, prompt.reordered(order), options).tolist()
        by_index = [0.0] * len(order)
        for pos, i in enumerate(order):
            by_index[i] = scores[pos]
        history.append(by_index)
        order = sorted(order, key=lambda i: -by_index[i] if first else by_index[i])
    return order, history


class AttentionSortBackend(HFBackend):
    """The ``attention-sort`` backend: each task prompt's passages sorted by (calibrated)
    attention, then answered with the model's own attention (see the module docstring).

    Args:
        model, tokenizer, adapter: as for :class:`~ragfix.backends.hf.HFBackend`.
        **options: :class:`AttentionSortOptions`.

    Raises:
        RagfixError: (when answering) a prompt without passage spans.
    """

    name: ClassVar[str] = "attention-sort"
    options_model: ClassVar[type[BackendOptions]] = AttentionSortOptions
    needs_passage_spans = True
    sliding_rule = "scores average the selected layers whose window holds every passage"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = with_place(self.options, self.model_name)
        self._sorted: dict[TaskPrompt, TaskPrompt] = {}

    def sorted_prompt(self, prompt: Prompt) -> TaskPrompt:
        """``prompt`` with its passages in attention-sorted order (memoised per prompt).

        Raises:
            RagfixError: a prompt without passage spans.
        """
        prompt = spans_required(self, prompt, SORTS)
        if prompt not in self._sorted:
            if len(self._sorted) >= _SORTED_CACHE:
                self._sorted.pop(next(iter(self._sorted)))
            order, _ = sort_passages(self, prompt, self.options)
            self._sorted[prompt] = prompt.reordered(order)
        return self._sorted[prompt]

    def fit(self, prompt: Prompt, max_new_tokens: int | None = None) -> Fit:
        """See :meth:`~ragfix.backends.base.Backend.fit`: the verdict on the sorted prompt (what
        the model answers), except that a prompt whose tokens as given (what the attention pass
        reads) plus the budget exceed the window is flagged on that count at once, without any
        attention pass: sorting moves the passages, it does not shorten the prompt.

        Raises:
            RagfixError: a prompt without passage spans.
        """
        prompt = spans_required(self, prompt, SORTS)
        budget, _ = answer_rules(prompt, max_new_tokens, None)
        given = len(self.tokenize(chat_text(self.tokenizer, prompt)))
        if given + budget > self.context_window:
            return Fit(
                prompt_tokens=given,
                budget=budget,
                window=self.context_window,
                cuts_long_prompts=self.cuts_long_prompts,
            )
        return super().fit(prompt, max_new_tokens)

    def read_prompt(self, prompt: Prompt) -> TaskPrompt:
        """See :meth:`~ragfix.backends.base.Backend.read_prompt`: the sorted prompt."""
        return self.sorted_prompt(prompt)

    def forget_prompts(self) -> None:
        """See :meth:`~ragfix.backends.base.Backend.forget_prompts`: the memoised sorts go too."""
        super().forget_prompts()
        self._sorted.clear()

    def format_prompt(self, prompt: Prompt) -> str:
        """The text the model reads: the sorted prompt (:meth:`sorted_prompt`) in the chat
        template. Every way of answering (generate, next_token_logprobs, loglikelihood,
        stream, fit) reads the prompt through here.

        Raises:
            RagfixError: a prompt without passage spans.
        """
        return chat_text(self.tokenizer, self.sorted_prompt(prompt))


__all__ = [
    "AttentionSortBackend",
    "calibrated_attention",
    "combine_scores",
    "passage_attention",
    "passage_scores",
    "sort_passages",
    "whole_view",
]
