"""Where a task prompt's passages are among the tokens a model reads: what the attention methods
that treat passages as units share (none imports another method).

* :func:`spans_required`: the one-line refusal of a prompt that does not say where its passages
  are (a plain text, a framework's or a client's prompt);
* :func:`passage_tokens`: the prompt's tokens as the backend reads them (chat template applied)
  and, per token, its passage (``attention-sort``, ``calibrated-attention``);
* :class:`PassageSet`, :func:`passage_set`, :func:`padded_batch`, :class:`PassageSetBackend`: the
  prompt as a set of separately tokenized passages between a prefix and a suffix, and the base of
  the backends that read it so (``set-based``, ``pine``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragfix.backends.base import Prompt
from ragfix.backends.hf import HFBackend, chat_text
from ragfix.backends.layout import LayoutBackend
from ragfix.errors import RagfixError
from ragfix.prompts import TaskPrompt

#: the block of a token outside the passages (before or after the set)
OUTSIDE = -1
#: the block of a padding token
PAD = -2


def spans_required(backend: HFBackend, prompt: Prompt, does: str) -> TaskPrompt:
    """``prompt`` as a task prompt with passage spans, or a closed-book task prompt (no
    passages by construction, :attr:`TaskPrompt.closed_book`: the methods read it as the model
    does, every passage function here giving it no passage).

    Args:
        does: what the backend does with the passages, for the message (``"sorts a prompt's
            passages"``).

    Raises:
        RagfixError: a plain string or a task prompt without spans (one line naming the backend).
    """
    if not isinstance(prompt, TaskPrompt) or not (prompt.passages or prompt.closed_book):
        raise RagfixError(
            f"backend {backend.name!r} {does} and this prompt does not say where they are (a "
            "plain text, or a prompt built without passages): use a task prompt (ragfix eval, "
            "ragfix judge) or another backend"
        )
    return prompt


def passage_tokens(backend: HFBackend, prompt: TaskPrompt) -> tuple[list[int], list[int], int]:
    """The tokens ``backend`` reads for ``prompt`` (:func:`~ragfix.backends.hf.chat_text`,
    tokenized as :meth:`~ragfix.backends.hf.HFBackend.encode` does) and where its passages are.

    A token belongs to the piece of text its first character is in (the fast tokenizer's
    offsets against :attr:`TaskPrompt.passages`).

    Returns:
        ``(ids, blocks, first)``: the token ids; per token the index of its passage or
        :data:`OUTSIDE`; the index of the first token after the last
        passage (``len(ids)`` when none).

    Raises:
        RagfixError: a tokenizer without offsets (not a fast tokenizer).
    """
    text = chat_text(backend.tokenizer, prompt)
    offset = text.find(prompt.user)
    enc = backend.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if "offset_mapping" not in enc:
        raise RagfixError(
            f"{backend.model_name}: finding a prompt's passages among its tokens needs a fast "
            "tokenizer (offsets)"
        )
    ids, starts = enc["input_ids"], [a for a, _ in enc["offset_mapping"]]
    spans = [(offset + a, offset + b) for a, b in prompt.passages]
    blocks = [next((j for j, (a, b) in enumerate(spans) if a <= c < b), OUTSIDE) for c in starts]
    end = spans[-1][1] if spans else 0
    first = next((t for t, c in enumerate(starts) if c >= end), len(ids))
    return ids, blocks, first


@dataclass(frozen=True)
class PassageSet:
    """A prompt as a set: token ids before the passages, of each passage (its separator
    included), and after them."""

    prefix: list[int]
    passages: list[list[int]]
    suffix: list[int]

    @property
    def ids(self) -> list[int]:
        """The tokens in prompt order."""
        return [*self.prefix, *(t for p in self.passages for t in p), *self.suffix]

    def blocks(self) -> list[int]:
        """Per token: the index of its passage, or :data:`OUTSIDE`."""
        out = [OUTSIDE] * len(self.prefix)
        for i, p in enumerate(self.passages):
            out += [i] * len(p)
        return out + [OUTSIDE] * len(self.suffix)

    def positions(self, align: str) -> list[int]:
        """Per token: its position ID under ``align`` (see the module docstring)."""
        n, lengths = len(self.prefix), [len(p) for p in self.passages]
        out = list(range(n))
        end = n + sum(lengths)
        for size in lengths:
            first = end - size if align == "end" else n
            out += range(first, first + size)
        after = end if align == "end" else n + max(lengths, default=0)
        return out + list(range(after, after + len(self.suffix)))


def passage_set(backend: HFBackend, prompt: Prompt) -> PassageSet:
    """The set layout of ``prompt`` as ``backend`` reads it (chat template applied).

    Raises:
        RagfixError: a plain-string prompt, or a task prompt without passage spans.
    """
    prompt = spans_required(backend, prompt, "reads a prompt's passages as a set")
    text = backend.format_prompt(prompt)
    if not prompt.passages:  # closed-book: every token before the (empty) set
        return PassageSet(prefix=backend.tokenize(text), passages=[], suffix=[])
    offset = text.find(prompt.user)
    first, last = prompt.passages[0][0], prompt.passages[-1][1]
    sep = prompt.passage_separator
    return PassageSet(
        prefix=backend.tokenize(text[: offset + first]),
        passages=[backend.tokenize(t + sep) for t in prompt.passage_texts()],
        suffix=backend.tokenize(text[offset + last :]),
    )


@dataclass(frozen=True)
class SetBatch:
    """A left-padded batch of passage sets: ``ids``, ``positions`` (position IDs) and ``blocks``
    (passage index, :data:`OUTSIDE` or :data:`PAD`), each ``[B, T]`` (int64, CPU), padded on
    the left."""

    ids: torch.Tensor
    positions: torch.Tensor
    blocks: torch.Tensor


def padded_batch(
    sets: Sequence[PassageSet], extra: Sequence[Sequence[int]], align: str, pad_id: int
) -> SetBatch:
    """The batch of ``sets``, each followed by its ``extra`` tokens (outside the passages, at the
    positions after its last), positions as :meth:`PassageSet.positions` under ``align``."""
    extra = list(extra) or [[] for _ in sets]
    rows = []
    for s, more in zip(sets, extra, strict=True):
        pos = s.positions(align)
        start = pos[-1] + 1
        rows.append(
            (
                [*s.ids, *more],
                [*pos, *range(start, start + len(more))],
                [*s.blocks(), *[OUTSIDE] * len(more)],
            )
        )
    width = max(len(r[0]) for r in rows)
    pads = [width - len(r[0]) for r in rows]
    return SetBatch(
        ids=torch.tensor([[pad_id] * n + r[0] for n, r in zip(pads, rows, strict=True)]),
        positions=torch.tensor([[0] * n + r[1] for n, r in zip(pads, rows, strict=True)]),
        blocks=torch.tensor([[PAD] * n + r[2] for n, r in zip(pads, rows, strict=True)]),
    )


class PassageSetBackend(LayoutBackend):
    """A backend that reads a task prompt's passages as a set (:func:`passage_set`): the base of
    ``set-based`` and ``pine``, which differ only in how one forward pass over a batch of sets
    attends (:meth:`_run`). Refuses prompts without passage spans in one line, and declares it
    (:attr:`~ragfix.backends.base.Backend.needs_passage_spans`); no prefix reuse (a cached
    prefix of another prompt was computed under another layout).
    """

    needs_passage_spans = True

    def _layout(self, prompt: Prompt) -> PassageSet:
        """The set layout of ``prompt`` (:func:`passage_set`).

        Raises:
            RagfixError: a prompt without passage spans.
        """
        return passage_set(self, prompt)

    def _run(self, sets: Sequence[PassageSet], extra: Sequence[Sequence[int]] = ()):
        """One forward pass over a left-padded batch of ``sets`` (each followed by its ``extra``
        tokens, which attend to everything before them, like the text after the set).

        Returns:
            ``(logits, step)``: ``[B, n, vocab]`` logits of the pass's last ``n = 1 +
            max(len(extra))`` positions, and the cached decoding step (``[B, 1]`` next token
            ids -> ``[B, 1, vocab]`` logits).
        """
        raise NotImplementedError


__all__ = [
    "OUTSIDE",
    "PAD",
    "PassageSet",
    "PassageSetBackend",
    "SetBatch",
    "padded_batch",
    "passage_set",
    "passage_tokens",
    "spans_required",
]
