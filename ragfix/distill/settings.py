"""The settings of a Pos2Distill run and the names of the files it writes (arXiv 2508.15709)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: training rows and teacher answers, reused by a rerun with the same data settings
DATA_FILE = "distill_data.json"
#: the teacher's generations so far, one JSON record per question (an interrupted run resumes)
TEACHER_FILE = "teacher_answers.jsonl"
#: one JSON record per optimiser step (loss, learning rate, KL by position)
LOG_FILE = "train_log.jsonl"
#: folder of the resumable training state (``accelerate`` checkpoint plus :data:`STATE_FILE`)
CHECKPOINT_DIR = "checkpoint"
#: step, last loss and settings of a checkpoint, written last
STATE_FILE = "ragfix_train_state.json"


class DistillSettings(BaseModel):
    """Every setting of a Pos2Distill run (stored in the adapter's metadata).

    The defaults are the paper's where it gives one (section 3.3 and appendix C: K = 4,
    lambda = 1, effective batch 32, one anchoring copy, cosine schedule with 5% warmup); learning
    rate 1e-4 is for LoRA (the paper's 3e-6 is for full fine-tuning). CPU-sized runs lower
    ``num_docs``, ``max_passage_words``, ``effective_batch`` and ``max_steps``.

    Raises:
        pydantic.ValidationError: an unknown or out-of-range setting.
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
    max_answer_words: int | None = Field(
        12, ge=1, description="drop QA (R2: final) teacher answers of more words a hop"
    )
    r2_max_new_tokens: int = Field(160, ge=8)
    seed: int = 42

    def generation_key(self) -> dict:
        """The settings that determine one teacher generation (its prompt and length): a stored
        generation is reused by any run that matches them, whatever its question count or rows."""
        keep = ["variant", "num_docs", "max_passage_words", "anchor_position", "r2_max_new_tokens"]
        return {k: getattr(self, k) for k in keep}

    def data_key(self) -> dict:
        """The settings that determine the training data (a cached data file must match them):
        those of the generations, and those that filter them and make the rows."""
        rows = [
            "questions",
            "positions_per_question",
            "anchor_copies",
            "max_answer_tokens",
            "max_answer_words",
            "seed",
        ]
        return {**self.generation_key(), **{k: getattr(self, k) for k in rows}}


__all__ = [
    "CHECKPOINT_DIR",
    "DATA_FILE",
    "LOG_FILE",
    "STATE_FILE",
    "TEACHER_FILE",
    "DistillSettings",
]
