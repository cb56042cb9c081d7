"""Tokenised training rows and the forward pass that reads the answer logits (Pos2Distill,
arXiv 2508.15709, section 3.1).

**Alignment.** We use the clean next-token alignment: the logits at prompt positions
``prompt_len - 1 .. end - 2`` predict the answer tokens, so the first answer token counts and
nothing after EOS does. The official code (inherited from OpenRLHF's KDLoss) takes the logits at
the answer tokens' own positions (one token later), dropping the first answer token's prediction
and adding the prediction after EOS.

These functions are the trainer's internals: they take the ``transformers`` model and tokenizer
being trained, not a :class:`~ragfix.backends.base.Backend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Example:
    """A tokenised training row.

    Attributes:
        prompt_ids: chat-formatted prompt tokens. answer_ids: answer tokens, EOS last.
        position: the gold position the loss weights group by (R1: the student's gold position;
            R2: the first gold position). anchor: anchoring row. key: the question (teacher cache).
    """

    prompt_ids: list[int]
    answer_ids: list[int]
    position: int
    anchor: bool
    key: str


def answer_token_ids(tokenizer, answer: str, max_tokens: int) -> list[int]:
    """Answer tokens (no special tokens), cut to ``max_tokens``, then EOS."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:max_tokens]
    return [*ids, tokenizer.eos_token_id]


def collate(examples: Sequence[Example], pad_id: int, device) -> dict:
    """Left-padded batch whose answers all end at the last column.

    Returns:
        dict with ``input_ids``, ``attention_mask``, ``position_ids`` (int64 ``[B, T]``),
        ``keep`` (int: logits to keep, ``L + 1`` for the longest answer ``L``), ``mask`` (bool
        ``[B, L]``: which of the first ``L`` kept logits predict an answer token) and ``targets``
        (int64 ``[B, L]``, the answer tokens right-aligned, 0 where masked).
    """
    seqs = [e.prompt_ids + e.answer_ids for e in examples]
    width = max(len(s) for s in seqs)
    longest = max(len(e.answer_ids) for e in examples)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.bool)
    targets = torch.zeros((len(seqs), longest), dtype=torch.long)
    for b, (s, e) in enumerate(zip(seqs, examples, strict=True)):
        ids[b, width - len(s) :] = torch.tensor(s)
        attn[b, width - len(s) :] = 1
        n = len(e.answer_ids)
        mask[b, longest - n :] = True
        targets[b, longest - n :] = torch.tensor(e.answer_ids)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": ids.to(device),
        "attention_mask": attn.to(device),
        "position_ids": pos.to(device),
        "keep": longest + 1,
        "mask": mask.to(device),
        "targets": targets.to(device),
    }


def answer_logits(model, batch: dict) -> torch.Tensor:
    """Logits that predict the answer tokens (clean next-token alignment), float32 ``[B, L, V]``.

    Only the last ``L + 1`` positions are projected to the vocabulary (``logits_to_keep``)."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=batch["keep"],
        use_cache=False,
    )
    return out.logits[:, :-1].float()


@torch.no_grad()
def teacher_logprobs(model, example: Example) -> torch.Tensor:
    """Teacher log-probabilities over the answer tokens of one example, float32 ``[n, V]`` on CPU
    (``n`` = answer tokens including EOS). The model must be the frozen initial model.

    The teacher prompt is the same for every row of a question, so this runs once per question
    and the result serves all its rows: exactly what a frozen teacher copy would give each row."""
    batch = collate([example], pad_id=0, device=next(model.parameters()).device)
    return torch.log_softmax(answer_logits(model, batch)[0], dim=-1).cpu()


def stack_teacher(
    examples: Sequence[Example], cache: dict[str, torch.Tensor], longest: int, device
) -> torch.Tensor:
    """Cached teacher log-probs right-aligned into float32 ``[B, L, V]`` (zeros where masked).

    Raises:
        ValueError: a cached teacher has another number of answer tokens than its row (a bug of
            the caller: teacher and student must share the answer tokens).
    """
    first = cache[examples[0].key]
    out = torch.zeros((len(examples), longest, first.shape[-1]), dtype=torch.float32)
    for b, e in enumerate(examples):
        t = cache[e.key]
        if t.shape[0] != len(e.answer_ids):
            raise ValueError(
                f"teacher has {t.shape[0]} answer tokens for {e.key}, student "
                f"{len(e.answer_ids)}: teacher and student must share the answer tokens"
            )
        out[b, longest - t.shape[0] :] = t
    return out.to(device)


__all__ = [
    "Example",
    "answer_logits",
    "answer_token_ids",
    "collate",
    "stack_teacher",
    "teacher_logprobs",
]
