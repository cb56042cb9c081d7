"""Pos2Distill training: position-to-position distillation into a LoRA adapter (or full weights).

Source: Wang et al., "Pos2Distill: Position Bias Distillation", arXiv 2508.15709 (EMNLP 2025),
sections 3.1-3.3 and appendix C, and its official code (``AMAP-ML/Pos2Distill``:
``create_datasets.py``, ``kd/loss_design.py``).

The model teaches itself: its answer with the gold passage at the advantaged ("sink") position is
the target for prompts where the same gold passage sits elsewhere.

**R1 (retrieval).** For each training question the teacher prompt has the gold passage at the
anchor position with the distractors in their file order; the teacher's greedy answer ``R_adv`` is
kept only when it is correct. Each kept question gives ``K`` rows with the gold passage at ``K``
distinct other ("trivial") positions and ``anchor_copies`` rows at the anchor position, the
distractors re-shuffled in every row (same distractor set). The loss of a row is the token-level
KL(teacher || student) averaged over the answer tokens (``R_adv`` plus EOS), the teacher being the
frozen initial model on the teacher prompt, whose log-probabilities are computed once per question.
Rows are weighted over the whole effective batch by :func:`position_weights`.

**R2 (reasoning).** Questions with two gold passages; the teacher prompt puts them at the last two
positions and the teacher's greedy chain of thought, ending in "The answer is: ...", is kept when
its extracted answer is correct; ``K`` rows with the two gold passages at other ordered position
pairs are trained with the cross-entropy of that chain of thought. No multi-hop dataset is
installable offline, so :func:`compose_two_passage` builds two-passage questions from pairs of NQ
samples (both answers required).

Modules: :mod:`~ragfix.distill.settings` (the settings), :mod:`~ragfix.distill.data` (rows,
teacher answers, filtering), :mod:`~ragfix.distill.batches` (tokenised rows, answer logits),
:mod:`~ragfix.distill.losses` (KL, CE, position weights), :mod:`~ragfix.distill.loop` (training),
:mod:`~ragfix.distill.checkpoint` (resumable state via ``accelerate``),
:mod:`~ragfix.distill.artefacts` (the adapter folder) and :mod:`~ragfix.distill.pipeline`
(:func:`distill`, the whole run). Loading an adapter is a model-loading concern:
:func:`ragfix.lora.load_adapter` (every backend takes ``adapter=PATH``).
"""

from ragfix.distill.artefacts import adapter_metadata, save_adapter
from ragfix.distill.batches import (
    Example,
    answer_logits,
    answer_token_ids,
    collate,
    stack_teacher,
    teacher_logprobs,
)
from ragfix.distill.data import (
    DistillRow,
    MultiHopSample,
    TeacherReport,
    answer_problem,
    arrange,
    build_rows,
    compose_two_passage,
    exclude_questions,
    extract_final_answer,
    r1_rows,
    r2_correct,
    r2_rows,
    resolve_anchor,
    shorten_sample,
    student_prompt,
    teacher_prompt,
    truncate_passage,
)
from ragfix.distill.loop import TrainResult, total_steps, train_loop, wrap_for_training
from ragfix.distill.losses import per_sample_ce, per_sample_kl, position_weights
from ragfix.distill.pipeline import distill
from ragfix.distill.settings import CHECKPOINT_DIR, DATA_FILE, LOG_FILE, DistillSettings

__all__ = [
    "CHECKPOINT_DIR",
    "DATA_FILE",
    "LOG_FILE",
    "DistillRow",
    "DistillSettings",
    "Example",
    "MultiHopSample",
    "TeacherReport",
    "TrainResult",
    "adapter_metadata",
    "answer_logits",
    "answer_problem",
    "answer_token_ids",
    "arrange",
    "build_rows",
    "collate",
    "compose_two_passage",
    "distill",
    "exclude_questions",
    "extract_final_answer",
    "per_sample_ce",
    "per_sample_kl",
    "position_weights",
    "r1_rows",
    "r2_correct",
    "r2_rows",
    "resolve_anchor",
    "save_adapter",
    "shorten_sample",
    "stack_teacher",
    "student_prompt",
    "teacher_logprobs",
    "teacher_prompt",
    "total_steps",
    "train_loop",
    "truncate_passage",
    "wrap_for_training",
]
