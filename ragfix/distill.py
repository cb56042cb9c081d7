"""Pos2Distill training: position-to-position distillation into a LoRA adapter (or full weights).

Source: Wang et al., "Pos2Distill: Position Bias Distillation", arXiv 2508.15709 (EMNLP 2025),
sections 3.1-3.3 and appendix C, and its official code (``AMAP-ML/Pos2Distill``:
``create_datasets.py``, ``kd/loss_design.py``); details in ``shared/research/seed-methods.md``
section 3.

The model teaches itself: its answer with the gold passage at the advantaged ("sink") position is
the target for prompts where the same gold passage sits elsewhere.

**R1 (retrieval).** For each training question the teacher prompt has the gold passage at the
anchor position with the distractors in their file order; the teacher's greedy answer ``R_adv`` is
kept only when it is correct. Each kept question gives ``K`` rows with the gold passage at ``K``
distinct other ("trivial") positions and ``anchor_copies`` rows at the anchor position, the
distractors re-shuffled in every row (same distractor set). The loss of a row is the token-level
KL(teacher || student) averaged over the answer tokens (``R_adv`` plus EOS), the teacher being the
frozen initial model on the teacher prompt. Because the teacher prompt is the same for all rows of
a question, its log-probabilities are computed once per question and cached: exactly what a frozen
teacher copy would produce for every row (:func:`teacher_logprobs`).

Weights over the whole effective batch (:func:`position_weights`): anchor rows get ``lambda``;
a row at trivial position ``i`` gets ``softmax_i(mean KL at i) * P / n_i * KL_b / max_{b' at i} KL``
(``P`` distinct trivial positions in the batch, ``n_i`` rows at ``i``), detached. The batch loss is
``sum_b w_b * KL_b`` (the paper's ``L_Act + lambda * L_Anc``). Weights need every row's KL before
any backward pass, so each optimiser step runs two passes: a no-grad pass that computes the KLs of
the effective batch (gathered across processes), then the weighted forward/backward pass.

**Alignment.** We use the clean next-token alignment: the logits at prompt positions
``prompt_len - 1 .. end - 2`` predict the answer tokens, so the first answer token counts and
nothing after EOS does. The official code (inherited from OpenRLHF's KDLoss) takes the logits at
the answer tokens' own positions (one token later), dropping the first answer token's prediction
and adding the prediction after EOS.

**R2 (reasoning).** Questions with two gold passages; the teacher prompt puts them at the last two
positions and the teacher's greedy chain of thought, ending in "The answer is: ...", is kept when
its extracted answer is correct; ``K`` rows with the two gold passages at other ordered position
pairs are trained with the cross-entropy of that chain of thought (token mean per row, mean over the
effective batch). No multi-hop dataset is installable offline, so :func:`compose_two_passage` builds
two-passage questions from pairs of NQ samples (both answers required).

Training: LoRA through ``peft`` (or full fine-tuning), ``accelerate`` (one CPU, one GPU or several
with ``accelerate launch``), gradient accumulation to the effective batch, AdamW (betas 0.9/0.95,
weight decay 0.01), cosine schedule with 5% warmup down to 10% of the peak rate, gradient clipping
1.0, a resumable checkpoint every ``save_every`` steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from ragfix.io import atomic_write_json
from ragfix.metrics import best_subspan_em, normalize_answer
from ragfix.models import model_identity
from ragfix.prompts import TaskPrompt, render_document, score_answer, task_prompt
from ragfix.types import Passage, QASample

#: adapter metadata file written next to the peft adapter files (checked by the backend)
METADATA_FILE = "ragfix_adapter.json"
#: full fine-tuning weights (safetensors state dict of the whole model)
FULL_WEIGHTS_FILE = "model.safetensors"
CHECKPOINT_FILE = "checkpoint.pt"
DATA_FILE = "distill_data.json"
LOG_FILE = "train_log.jsonl"
FORMAT = "ragfix-pos2distill"

R2_INSTRUCTION = (
    "Let's first identify the relevant information from the long context and list it. Then, "
    "carry out step-by-step reasoning based on that information, and finally, provide the answer. "
    "The final answer must end with \u201cThe answer is:\u201d."
)
_ANSWER_IS = re.compile(r"the answer is[:\uff1a]?\s*(.*)", re.IGNORECASE)


class DistillSettings(BaseModel):
    """Every setting of a Pos2Distill run (stored in the adapter's metadata).

    The defaults are the paper's where it gives one (K = 4, lambda = 1, effective batch 32, one
    anchoring copy, cosine schedule with 5% warmup); learning rate 1e-4 is for LoRA (the paper's
    3e-6 is for full fine-tuning). CPU-sized runs lower ``num_docs``, ``max_passage_words``,
    ``effective_batch`` and ``max_steps``.
    """

    model_config = ConfigDict(extra="forbid")

    variant: Literal["r1", "r2"] = "r1"
    num_docs: int = Field(10, ge=2)
    max_passage_words: int | None = Field(None, ge=8)
    questions: int = Field(300, ge=1, description="correct teacher answers to keep")
    positions_per_question: int = Field(4, ge=1, description="K: trivial positions per question")
    anchor_position: int = Field(0, description="advantaged (sink) position, 0-based; -1 = last")
    anchor_copies: int = Field(1, ge=0)
    anchor_weight: float = Field(1.0, ge=0, description="lambda of the anchoring term")
    full_finetune: bool = False
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: str = "all-linear"
    lr: float = Field(1e-4, gt=0)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(
        None, ge=1, description="cap on optimiser steps (schedule length)"
    )
    effective_batch: int = Field(32, ge=1)
    micro_batch: int = Field(1, ge=1)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    save_every: int = Field(10, ge=1)
    max_answer_tokens: int = Field(32, ge=1)
    r2_max_new_tokens: int = Field(160, ge=8)
    seed: int = 42

    def data_key(self) -> dict:
        """The settings that determine the training data (a cached data file must match them)."""
        keep = [
            "variant",
            "num_docs",
            "max_passage_words",
            "questions",
            "positions_per_question",
            "anchor_position",
            "anchor_copies",
            "max_answer_tokens",
            "r2_max_new_tokens",
            "seed",
        ]
        return {k: getattr(self, k) for k in keep}


# ---------------------------------------------------------------------------------- data
class MultiHopSample(BaseModel):
    """A question that needs several gold passages (R2).

    Attributes:
        id: stable id. question: the question text.
        answers: one list of accepted answers per hop; correct means every hop's answer appears.
        golds: the gold passages (one per hop). distractors: the other passages, fixed order.
    """

    id: str
    question: str
    answers: list[list[str]]
    golds: list[Passage]
    distractors: list[Passage]
    source: str = ""


class DistillRow(BaseModel):
    """One training row: where the gold passage(s) go and in which order the distractors come.

    Attributes:
        sample_id: the question. positions: gold position(s) in the student prompt (0-based).
        order: permutation of the sample's distractor indices for the student prompt.
        anchor: whether this is an anchoring row (R1 gold at the anchor position).
        answer: the teacher's answer text (R1: ``R_adv``; R2: the chain of thought).
    """

    sample_id: str
    positions: list[int]
    order: list[int]
    anchor: bool = False
    answer: str


def truncate_passage(p: Passage, max_words: int | None, answers: Sequence[str] = ()) -> Passage:
    """``p`` cut to ``max_words`` words; for a gold passage the window keeps the first occurrence
    of an answer (centred on it when possible), so truncation never removes the evidence."""
    words = p.text.split()
    if max_words is None or len(words) <= max_words:
        return p
    start = 0
    low = p.text.lower()
    for a in answers:
        at = low.find(a.lower())
        if at >= 0:
            start = max(0, min(len(p.text[:at].split()) - max_words // 2, len(words) - max_words))
            break
    return p.model_copy(update={"text": " ".join(words[start : start + max_words])})


def shorten_sample(sample: QASample, max_words: int | None) -> QASample:
    """``sample`` with every passage truncated to ``max_words`` words (KV samples unchanged)."""
    if max_words is None or sample.task == "kv":
        return sample
    return sample.model_copy(
        update={
            "gold": truncate_passage(sample.gold, max_words, sample.answers),
            "distractors": [truncate_passage(d, max_words) for d in sample.distractors],
        }
    )


def resolve_anchor(anchor_position: int, num_docs: int) -> int:
    """The 0-based anchor position (``-1`` = last).

    Raises:
        ValueError: outside ``-num_docs .. num_docs - 1``.
    """
    if not -num_docs <= anchor_position < num_docs:
        raise ValueError(f"anchor_position {anchor_position} out of range for {num_docs} documents")
    return anchor_position % num_docs


def arrange(sample: QASample | MultiHopSample, positions: Sequence[int], order=None):
    """The context of ``sample`` with its distractors in ``order`` (default: file order) and its
    gold passage(s) at ``positions`` (0-based positions in the final list, ascending or not).

    Raises:
        ValueError: wrong number of positions, repeated or out-of-range positions, or ``order``
            is not a permutation of the distractor indices.
    """
    golds = [sample.gold] if isinstance(sample, QASample) else list(sample.golds)
    n = len(sample.distractors) + len(golds)
    if len(positions) != len(golds) or len(set(positions)) != len(golds):
        raise ValueError(f"need {len(golds)} distinct gold positions, got {list(positions)}")
    if any(not 0 <= p < n for p in positions):
        raise ValueError(f"gold positions {list(positions)} out of range 0..{n - 1}")
    order = list(range(len(sample.distractors))) if order is None else list(order)
    if sorted(order) != list(range(len(sample.distractors))):
        raise ValueError("order must be a permutation of the distractor indices")
    rest = iter(sample.distractors[i] for i in order)
    at = dict(zip(positions, golds, strict=True))
    return [at[i] if i in at else next(rest) for i in range(n)]


def r2_prompt(sample: MultiHopSample, passages: list[Passage], max_new_tokens: int) -> TaskPrompt:
    """The R2 chain-of-thought prompt (paper's instruction, documents numbered from 1)."""
    docs = "\n".join(render_document(i + 1, p) for i, p in enumerate(passages))
    return TaskPrompt(
        user=f"{R2_INSTRUCTION}\n\n{docs}\n\nQuestion: {sample.question}",
        max_new_tokens=max_new_tokens,
        stop_at_newline=False,
    )


def extract_final_answer(text: str) -> str:
    """The text after the last "The answer is:" (the R2 evaluation rule), or "" if absent."""
    found = _ANSWER_IS.findall(text)
    return found[-1].strip() if found else ""


def r2_correct(sample: MultiHopSample, text: str) -> bool:
    """Every hop's answer (best_subspan_em) is in the extracted final answer."""
    final = extract_final_answer(text)
    return bool(final) and all(best_subspan_em(final, hop) for hop in sample.answers)


def compose_two_passage(samples: Sequence[QASample], num_docs: int) -> list[MultiHopSample]:
    """Two-passage questions built from consecutive pairs of NQ samples: "Q1? And Q2?", whose
    answer must contain both answers; the two gold passages plus distractors from both samples.

    This is a stand-in for MuSiQue/HotpotQA (not installable offline): both passages are needed,
    but the second hop does not depend on the first one's answer.

    Raises:
        ValueError: ``num_docs`` < 3 or too few distractors in a pair.
    """
    if num_docs < 3:
        raise ValueError("two-passage questions need num_docs >= 3")
    out = []
    for a, b in zip(samples[0::2], samples[1::2], strict=False):
        pool = []
        for d in (x for pair in zip(a.distractors, b.distractors, strict=False) for x in pair):
            if d.title not in (a.gold.title, b.gold.title) and d not in pool:
                pool.append(d)
        if len(pool) < num_docs - 2:
            raise ValueError(f"{a.id}+{b.id}: only {len(pool)} distractors for {num_docs} docs")
        q1, q2 = a.question.rstrip(" ?"), b.question.rstrip(" ?")
        out.append(
            MultiHopSample(
                id=f"{a.id}+{b.id}",
                question=f"{q1}? And {q2}?",
                answers=[a.answers, b.answers],
                golds=[a.gold, b.gold],
                distractors=pool[: num_docs - 2],
                source=f"{a.source} + {b.source}",
            )
        )
    return out


def r1_rows(
    sample: QASample,
    answer: str,
    positions_per_question: int,
    anchor: int,
    anchor_copies: int,
    rng: random.Random,
) -> list[DistillRow]:
    """The R1 rows of one question: ``K`` distinct trivial positions (never the anchor) and
    ``anchor_copies`` rows at the anchor, each with a fresh shuffle of the same distractors."""
    trivial = [p for p in range(sample.num_docs) if p != anchor]
    chosen = sorted(rng.sample(trivial, min(positions_per_question, len(trivial))))
    rows = []
    for pos, is_anchor in [(p, False) for p in chosen] + [(anchor, True)] * anchor_copies:
        order = list(range(len(sample.distractors)))
        rng.shuffle(order)
        rows.append(
            DistillRow(
                sample_id=sample.id, positions=[pos], order=order, anchor=is_anchor, answer=answer
            )
        )
    return rows


def r2_rows(
    sample: MultiHopSample, answer: str, positions_per_question: int, rng: random.Random
) -> list[DistillRow]:
    """The R2 rows of one question: ``K`` distinct ordered position pairs other than the teacher's
    (the last two positions), each with a fresh shuffle of the distractors."""
    n = len(sample.distractors) + len(sample.golds)
    teacher = (n - 2, n - 1)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j and (i, j) != teacher]
    rows = []
    for pair in rng.sample(pairs, min(positions_per_question, len(pairs))):
        order = list(range(len(sample.distractors)))
        rng.shuffle(order)
        rows.append(
            DistillRow(sample_id=sample.id, positions=list(pair), order=order, answer=answer)
        )
    return rows


def teacher_prompt(sample, settings: DistillSettings) -> TaskPrompt:
    """The teacher prompt: distractors in file order, gold at the anchor (R1) or the two golds at
    the last two positions (R2)."""
    if isinstance(sample, MultiHopSample):
        n = len(sample.distractors) + len(sample.golds)
        return r2_prompt(sample, arrange(sample, [n - 2, n - 1]), settings.r2_max_new_tokens)
    pos = resolve_anchor(settings.anchor_position, sample.num_docs)
    return task_prompt(sample, arrange(sample, [pos]))


def student_prompt(sample, row: DistillRow, settings: DistillSettings) -> TaskPrompt:
    """The prompt of one training row."""
    passages = arrange(sample, row.positions, row.order)
    if isinstance(sample, MultiHopSample):
        return r2_prompt(sample, passages, settings.r2_max_new_tokens)
    return task_prompt(sample, passages)


def teacher_answer_text(sample, text: str) -> str:
    """What the student is trained on: R1 QA keeps the first line (as the metric reads it)."""
    if isinstance(sample, QASample) and sample.task == "qa":
        return text.strip().split("\n")[0].strip()
    return text.strip()


def build_rows(backend, samples: Sequence, settings: DistillSettings, progress=None):
    """Teacher answers at the advantaged position, filtered for correctness, and the rows.

    Args:
        backend: a :class:`~ragfix.backends.base.Backend` of the initial model (the teacher).
        samples: QA/KV samples (R1) or :class:`MultiHopSample` (R2), in the order to try them.
        progress: optional callable ``(done, total, kept)`` called after each batch.

    Returns:
        ``(kept_samples, rows, tried)``: the first ``settings.questions`` samples whose teacher
        answer is correct, their rows, and how many samples were tried.
    """
    rng = random.Random(settings.seed)
    kept, rows, tried = [], [], 0
    batch = 8
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        gens = backend.generate([teacher_prompt(s, settings) for s in chunk], batch_size=batch)
        tried += len(chunk)
        for s, g in zip(chunk, gens, strict=True):
            if len(kept) >= settings.questions:
                break
            ok = r2_correct(s, g.text) if isinstance(s, MultiHopSample) else score_answer(s, g.text)
            answer = teacher_answer_text(s, g.text)
            if not ok or not answer:
                continue
            kept.append(s)
            if isinstance(s, MultiHopSample):
                rows += r2_rows(s, answer, settings.positions_per_question, rng)
            else:
                anchor = resolve_anchor(settings.anchor_position, s.num_docs)
                rows += r1_rows(
                    s, answer, settings.positions_per_question, anchor, settings.anchor_copies, rng
                )
        if progress is not None:
            progress(tried, len(samples), len(kept))
        if len(kept) >= settings.questions:
            break
    return kept, rows, tried


def exclude_questions(samples: Sequence, excluded: Sequence) -> list:
    """``samples`` without any whose id or normalised question is among ``excluded``'s.

    Used to keep training questions disjoint from evaluation questions."""
    ids = {s.id for s in excluded}
    questions = {normalize_answer(s.question) for s in excluded}
    return [s for s in samples if s.id not in ids and normalize_answer(s.question) not in questions]


# ---------------------------------------------------------------------------------- tensors
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
    (``n`` = answer tokens including EOS). The model must be the frozen initial model."""
    batch = collate([example], pad_id=0, device=next(model.parameters()).device)
    return torch.log_softmax(answer_logits(model, batch)[0], dim=-1).cpu()


def stack_teacher(
    examples: Sequence[Example], cache: dict[str, torch.Tensor], longest: int, device
):
    """Cached teacher log-probs right-aligned into float32 ``[B, L, V]`` (zeros where masked)."""
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


def per_sample_kl(
    teacher_logp: torch.Tensor, student_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Token-level KL(teacher || student) averaged over each sample's answer tokens.

    Args:
        teacher_logp: float ``[B, L, V]`` teacher log-probabilities.
        student_logits: float ``[B, L, V]`` student logits (log-softmax is applied here).
        mask: bool ``[B, L]``, the answer tokens.

    Returns:
        float32 ``[B]``: ``KL_b = mean_t sum_v p_T (log p_T - log p_S)`` (nats).
    """
    logp_s = torch.log_softmax(student_logits.float(), dim=-1)
    tok = (teacher_logp.exp() * (teacher_logp - logp_s)).sum(-1)
    m = mask.float()
    return (tok * m).sum(-1) / m.sum(-1).clamp(min=1)


def per_sample_ce(student_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):
    """Cross-entropy of the target tokens averaged over each sample's answer tokens.

    Args: student_logits float ``[B, L, V]``; targets int64 ``[B, L]``; mask bool ``[B, L]``.

    Returns:
        float32 ``[B]`` (nats per token).
    """
    ce = F.cross_entropy(student_logits.float().transpose(1, 2), targets, reduction="none")
    m = mask.float()
    return (ce * m).sum(-1) / m.sum(-1).clamp(min=1)


def position_weights(
    kl: torch.Tensor, positions: torch.Tensor, anchor: torch.Tensor, anchor_weight: float = 1.0
) -> torch.Tensor:
    """Position-aware weights of Pos2Distill over one effective batch (detached).

    Args:
        kl: float ``[N]`` per-sample KL of the whole effective batch (all processes).
        positions: int ``[N]`` gold position of each sample.
        anchor: bool ``[N]``, anchoring samples (weight ``anchor_weight``, the paper's lambda).
        anchor_weight: lambda.

    Returns:
        float32 ``[N]``: for a trivial sample at position ``i``,
        ``softmax_i(m_i) * P / n_i * KL_b / max_{b' at i} KL_b'`` with ``m_i`` the mean KL at ``i``,
        ``n_i`` the count and ``P`` the number of distinct trivial positions in the batch
        (official code, ``kd/loss_design.py``; the paper's alpha_ij without the ``P / n_i``).
        A position whose KLs are all zero gets weight 0.
    """
    kl = kl.detach().float()
    w = torch.zeros_like(kl)
    w[anchor] = anchor_weight
    trivial = ~anchor
    if trivial.any():
        uniq = torch.unique(positions[trivial])
        means = torch.stack([kl[trivial & (positions == p)].mean() for p in uniq])
        c = torch.softmax(means, dim=0) * len(uniq)
        for p, ci in zip(uniq, c, strict=True):
            sel = trivial & (positions == p)
            top = kl[sel].max()
            if top > 0:
                w[sel] = ci / sel.sum() * kl[sel] / top
    return w


# ---------------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    """What a training run did: optimiser steps done, rows per step, last batch loss, minutes."""

    steps: int
    total_steps: int
    rows: int
    last_loss: float
    minutes: float
    finished: bool


def total_steps(n_rows: int, settings: DistillSettings) -> int:
    """Optimiser steps of a run: ``ceil(rows * epochs / effective_batch)``, capped by max_steps."""
    steps = math.ceil(n_rows * settings.epochs / settings.effective_batch)
    return min(steps, settings.max_steps) if settings.max_steps else steps


def row_schedule(n_rows: int, settings: DistillSettings) -> list[int]:
    """The row index of every training slot: one seeded shuffle per epoch, concatenated."""
    order: list[int] = []
    for epoch in range(settings.epochs):
        perm = list(range(n_rows))
        random.Random(settings.seed * 1000 + epoch).shuffle(perm)
        order += perm
    return order


def _trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def wrap_for_training(model, settings: DistillSettings):
    """The model with LoRA adapters (``peft``) or, for full fine-tuning, itself; in train mode.

    Gradient flows only into the LoRA matrices (or into every weight for full fine-tuning)."""
    if settings.full_finetune:
        for p in model.parameters():
            p.requires_grad_(True)
        return model.train()
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=settings.lora_targets,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg).train()


def train_loop(
    model,
    examples: Sequence[Example],
    settings: DistillSettings,
    out_dir: str | Path,
    teacher_cache: dict[str, torch.Tensor] | None = None,
    pad_id: int = 0,
    resume: bool = True,
    stop_after: int | None = None,
    accelerator=None,
    show_progress: bool = True,
) -> tuple[object, TrainResult]:
    """Train ``model`` on ``examples`` (R1: weighted KL against ``teacher_cache``; R2: CE).

    Args:
        model: the initial causal LM (fp32 or bf16), not yet wrapped; it is wrapped by
            :func:`wrap_for_training`.
        examples: tokenised rows. teacher_cache: question key -> ``[n, V]`` teacher log-probs
            (required for R1, see :func:`teacher_logprobs`).
        out_dir: where ``checkpoint.pt`` and ``train_log.jsonl`` go.
        resume: continue from ``out_dir/checkpoint.pt`` when it exists.
        stop_after: stop after this many steps in this call (a time-boxed run; the checkpoint is
            saved so a rerun continues).
        accelerator: an ``accelerate.Accelerator`` (one is made when ``None``).

    Returns:
        ``(trained_model, TrainResult)``; the model is unwrapped from accelerate.

    Raises:
        ValueError: R1 without a teacher cache, or a checkpoint from other settings.
    """
    from accelerate import Accelerator
    from accelerate.utils import gather_object
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    r1 = settings.variant == "r1"
    if r1 and teacher_cache is None:
        raise ValueError("R1 training needs the teacher's log-probabilities (teacher_cache)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(settings.seed)
    model = wrap_for_training(model, settings)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    steps = total_steps(len(examples), settings)
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt,
        num_warmup_steps=int(settings.warmup_ratio * steps),
        num_training_steps=steps,
        min_lr_rate=settings.min_lr_ratio,
    )
    # the scheduler stays unprepared: accelerate would step it once per process
    model, opt = acc.prepare(model, opt)
    order = row_schedule(len(examples), settings)
    step, last_loss = 0, float("nan")
    ckpt = out / CHECKPOINT_FILE
    if resume and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state["settings"] != settings.model_dump():
            raise ValueError(f"{ckpt}: checkpoint was written with other settings; remove it")
        named = dict(acc.unwrap_model(model).named_parameters())
        with torch.no_grad():
            for n, t in state["trainable"].items():
                named[n].copy_(t)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, last_loss = state["step"], state["loss"]
        torch.set_rng_state(state["rng"])
    device = acc.device
    rank, world = acc.process_index, acc.num_processes
    started, done_here = time.perf_counter(), 0

    def save_checkpoint() -> None:
        if acc.is_main_process:
            state = {
                "step": step,
                "loss": last_loss,
                "settings": settings.model_dump(),
                "trainable": _trainable_state(acc.unwrap_model(model)),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "rng": torch.get_rng_state(),
            }
            tmp = ckpt.with_suffix(".tmp")
            torch.save(state, tmp)
            tmp.replace(ckpt)
        acc.wait_for_everyone()

    def losses(chunk: list[Example]) -> torch.Tensor:
        batch = collate(chunk, pad_id, device)
        logits = answer_logits(model, batch)
        if r1:
            teacher = stack_teacher(chunk, teacher_cache, batch["mask"].shape[1], device)
            return per_sample_kl(teacher, logits, batch["mask"])
        return per_sample_ce(logits, batch["targets"], batch["mask"])

    cols = [
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
    ]
    with Progress(
        *cols, TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
        disable=not (show_progress and acc.is_main_process),
    ) as bar:  # fmt: skip
        task = bar.add_task(f"pos2distill {settings.variant}", total=steps, completed=step, info="")
        while step < steps and (stop_after is None or done_here < stop_after):
            slots = order[step * settings.effective_batch : (step + 1) * settings.effective_batch]
            mine = [examples[i] for i in slots[rank::world]]
            chunks = [
                mine[i : i + settings.micro_batch]
                for i in range(0, len(mine), settings.micro_batch)
            ]
            # pass 1 (R1): the KL of every row of the effective batch, gathered -> weights
            if r1:
                with torch.no_grad():
                    kl_mine = torch.cat([losses(c) for c in chunks]) if chunks else torch.zeros(0)
                gathered = gather_object(
                    [(float(k), e.position, e.anchor) for k, e in zip(kl_mine, mine, strict=True)]
                )
                kl_all = torch.tensor([g[0] for g in gathered])
                pos_all = torch.tensor([g[1] for g in gathered])
                anc_all = torch.tensor([g[2] for g in gathered], dtype=torch.bool)
                w_all = position_weights(kl_all, pos_all, anc_all, settings.anchor_weight)
                # gather_object concatenates ranks in order: this rank's slice of the weights
                sizes = gather_object([len(mine)])
                off = sum(sizes[:rank])
                w_mine = w_all[off : off + len(mine)].to(device)
            else:
                w_mine = torch.full((len(mine),), 1.0 / len(slots), device=device)
            # pass 2: weighted loss, gradients accumulated over the micro-batches
            total, at = 0.0, 0
            for j, c in enumerate(chunks):
                sync = j == len(chunks) - 1
                ctx = contextlib.nullcontext() if sync else acc.no_sync(model)
                with ctx:
                    loss = (w_mine[at : at + len(c)] * losses(c)).sum()
                    acc.backward(loss * world)  # DDP averages over processes: keep the sum
                total += float(loss.detach())
                at += len(c)
            if settings.grad_clip > 0:
                acc.clip_grad_norm_(params, settings.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            done_here += 1
            last_loss = float(sum(gather_object([total])))
            record: dict = {"step": step, "loss": last_loss, "lr": sched.get_last_lr()[0]}
            if r1:
                per_pos = {}
                for p in sorted(set(pos_all.tolist())):
                    sel = (pos_all == p) & ~anc_all
                    if sel.any():
                        per_pos[str(p)] = round(float(kl_all[sel].mean()), 4)
                if anc_all.any():
                    per_pos["anchor"] = round(float(kl_all[anc_all].mean()), 4)
                record["kl_by_position"] = per_pos
            if acc.is_main_process:
                with open(out / LOG_FILE, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            kl_info = " ".join(f"{k}:{v:.3f}" for k, v in record.get("kl_by_position", {}).items())
            bar.update(task, completed=step, info=f"loss {last_loss:.4f}  KL {kl_info}")
            if step % settings.save_every == 0 or step == steps or done_here == stop_after:
                save_checkpoint()
    result = TrainResult(
        steps=step,
        total_steps=steps,
        rows=len(examples),
        last_loss=last_loss,
        minutes=(time.perf_counter() - started) / 60,
        finished=step >= steps,
    )
    return acc.unwrap_model(model).eval(), result


# ---------------------------------------------------------------------------------- artefacts
def save_adapter(model, out_dir: str | Path, metadata: dict) -> Path:
    """Write the trained adapter (peft files, or the full weights) and ``ragfix_adapter.json``.

    The old metadata is removed first and the new one written last (atomically), so a folder with
    a metadata file always holds complete weights.

    Returns:
        the metadata path.
    """
    import shutil
    import tempfile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / METADATA_FILE).unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".adapter-"))
    try:
        if metadata["kind"] == "full":
            from safetensors.torch import save_file

            state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
            tied = getattr(model.config, "tie_word_embeddings", False)
            if tied:
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / FULL_WEIGHTS_FILE))
        else:
            model.save_pretrained(str(tmp))
        for f in tmp.iterdir():
            f.replace(out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_json(out / METADATA_FILE, metadata)
    return out / METADATA_FILE


def read_metadata(adapter_dir: str | Path) -> dict:
    """The metadata of an adapter folder.

    Raises:
        FileNotFoundError: not a finished ragfix Pos2Distill adapter folder.
        ValueError: the metadata is not of this format.
    """
    p = Path(adapter_dir) / METADATA_FILE
    if not p.is_file():
        raise FileNotFoundError(
            f"{adapter_dir}: no {METADATA_FILE} (not a finished `ragfix distill` adapter)"
        )
    meta = json.loads(p.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{p}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def check_base(meta: dict, model, where: str | Path) -> None:
    """Check that ``model`` is the base model the adapter was trained on.

    Raises:
        ValueError: the identities differ (architecture, sizes or weight fingerprint).
    """
    want, have = meta["base_model"], model_identity(model)
    fields = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size", "fingerprint")
    diff = [f for f in fields if want.get(f) != have.get(f)]
    if diff:
        raise ValueError(
            f"{where}: adapter was trained on base model {want.get('name')!r} "
            f"({want.get('architecture')}, fingerprint {want.get('fingerprint')}), but the loaded "
            f"model is {have.get('name')!r} ({have.get('architecture')}, fingerprint "
            f"{have.get('fingerprint')}); differing: {', '.join(diff)}"
        )


def apply_adapter(model, adapter_dir: str | Path, merge: bool = True):
    """Load a ``ragfix distill`` adapter onto ``model`` (checked to be its base model).

    Args:
        model: the base causal LM. adapter_dir: the folder ``ragfix distill`` wrote.
        merge: merge the LoRA weights into the base weights (plain model, same speed as the base
            model); ``False`` keeps a ``peft`` model (full fine-tuning is always "merged").

    Returns:
        ``(model, metadata)``.

    Raises:
        FileNotFoundError / ValueError: see :func:`read_metadata` and :func:`check_base`.
    """
    meta = read_metadata(adapter_dir)
    check_base(meta, model, adapter_dir)
    if meta["kind"] == "full":
        from safetensors.torch import load_file

        state = load_file(str(Path(adapter_dir) / FULL_WEIGHTS_FILE))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise ValueError(f"{adapter_dir}: weights do not fit the model ({unexpected[:3]})")
        return model.eval(), meta
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    return (peft_model.merge_and_unload() if merge else peft_model).eval(), meta


# ---------------------------------------------------------------------------------- pipeline
def distill(
    model_name: str,
    samples: Sequence,
    settings: DistillSettings,
    out_dir: str | Path,
    excluded: Sequence = (),
    train_files: Sequence[str] = (),
    device: str = "auto",
    dtype: str = "auto",
    resume: bool = True,
    stop_after: int | None = None,
    log=print,
) -> tuple[TrainResult, dict | None]:
    """The whole pipeline: teacher answers -> rows -> teacher log-probs -> training -> adapter.

    Args:
        model_name: see :func:`ragfix.models.load_model`.
        samples: candidate training samples (QA/KV for R1, :class:`MultiHopSample` for R2), tried
            in order until ``settings.questions`` are correct at the advantaged position.
        excluded: evaluation samples; any training candidate with the same id or question is
            dropped first, and their ids are recorded in the metadata.
        train_files: the data files, recorded in the metadata.
        stop_after: see :func:`train_loop`.
        log: called with one-line progress messages.

    Returns:
        ``(TrainResult, metadata)``; metadata is ``None`` when the run stopped early.

    Raises:
        ValueError: no correct teacher answer, or a checkpoint from other settings.
    """
    from accelerate import Accelerator

    from ragfix.backends import backend_class
    from ragfix.models import load_model

    acc = Accelerator(cpu=device == "cpu" or not torch.cuda.is_available())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(model_name, device=str(acc.device), dtype=dtype)
    teacher = backend_class("vanilla")(model, tok)
    base_identity = model_identity(model)
    candidates = exclude_questions(samples, excluded)
    dropped = len(samples) - len(candidates)
    by_id = {s.id: s for s in candidates}
    data_path = out / DATA_FILE
    cached = json.loads(data_path.read_text()) if resume and data_path.exists() else None
    if (
        cached
        and cached["data_key"] == settings.data_key()
        and all(i in by_id for i in cached["question_ids"])
    ):
        kept = [by_id[i] for i in cached["question_ids"]]
        rows = [DistillRow(**r) for r in cached["rows"]]
        tried = cached["tried"]
        log(f"reusing {data_path}: {len(kept)} questions, {len(rows)} rows")
    else:
        log(f"teacher answers at the advantaged position ({len(candidates)} candidates)")
        kept, rows, tried = build_rows(
            teacher,
            candidates,
            settings,
            progress=lambda d, t, k: log(f"  tried {d}/{t}, kept {k}/{settings.questions}"),
        )
        if acc.is_main_process:
            atomic_write_json(
                data_path,
                {
                    "data_key": settings.data_key(),
                    "question_ids": [s.id for s in kept],
                    "tried": tried,
                    "rows": [r.model_dump() for r in rows],
                },
            )
    if not kept:
        raise ValueError(f"no correct teacher answer among {tried} questions: nothing to learn")
    log(f"{len(kept)} of {tried} questions answered correctly by the teacher; {len(rows)} rows")
    by_kept = {s.id: s for s in kept}
    examples = []
    for r in rows:
        s = by_kept[r.sample_id]
        prompt = teacher.encode(student_prompt(s, r, settings))
        answer = answer_token_ids(tok, r.answer, settings.max_answer_tokens)
        examples.append(Example(prompt, answer, r.positions[0], r.anchor, r.sample_id))
    cache = None
    if settings.variant == "r1":
        log("teacher log-probabilities (once per question)")
        cache = {}
        for s in kept:
            first = next(e for e in examples if e.key == s.id)
            t_ex = Example(
                teacher.encode(teacher_prompt(s, settings)), first.answer_ids, 0, False, s.id
            )
            cache[s.id] = teacher_logprobs(model, t_ex)
    trained, result = train_loop(
        model,
        examples,
        settings,
        out,
        teacher_cache=cache,
        pad_id=tok.pad_token_id,
        resume=resume,
        stop_after=stop_after,
        accelerator=acc,
    )
    if not result.finished:
        return result, None
    metadata = {
        "format": FORMAT,
        "version": 1,
        "kind": "full" if settings.full_finetune else "lora",
        "variant": settings.variant,
        "base_model": base_identity,
        "train_files": list(train_files),
        "train_question_ids": [s.id for s in kept],
        "train_questions": [s.question for s in kept],
        "questions_tried": tried,
        "excluded_question_ids": sorted({s.id for s in excluded}),
        "excluded_candidates": dropped,
        "rows": len(rows),
        "steps": result.steps,
        "final_loss": result.last_loss,
        "train_minutes": round(result.minutes, 2),
        "settings": settings.model_dump(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if acc.is_main_process:
        save_adapter(trained, out, metadata)
        (out / CHECKPOINT_FILE).unlink(missing_ok=True)
    return result, metadata
