"""The Pos2Distill training loop (arXiv 2508.15709, section 3.3 and appendix C).

LoRA through ``peft`` (or full fine-tuning), ``accelerate`` (one CPU, one GPU or several with
``accelerate launch``), gradient accumulation to the effective batch, AdamW (betas 0.9/0.95,
weight decay 0.01), cosine schedule with 5% warmup down to 10% of the peak rate, gradient clipping
1.0, a resumable checkpoint every ``save_every`` steps (:mod:`ragfix.distill.checkpoint`).

R1 weights need every row's KL before any backward pass (:func:`~ragfix.distill.losses.
position_weights`), so each optimiser step runs two passes: a no-grad pass that computes the KLs
of the effective batch (gathered across processes), then the weighted forward/backward pass.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ragfix.distill.batches import Example, answer_logits, collate, stack_teacher
from ragfix.distill.checkpoint import load_checkpoint, register_checkpointing, save_checkpoint
from ragfix.distill.losses import per_sample_ce, per_sample_kl, position_weights
from ragfix.distill.settings import LOG_FILE, DistillSettings


@dataclass
class TrainResult:
    """What a training run did: optimiser steps done, rows per step, last batch loss, and the
    wall-clock training minutes of the steps done (a resumed run adds those of the checkpoint it
    resumed from; steps redone after an interruption count once)."""

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


def kl_by_position(kl: torch.Tensor, positions: torch.Tensor, anchor: torch.Tensor) -> dict:
    """Mean KL of the trivial rows at each position (keys ``"0"``, ``"1"`` ...) and of the
    anchoring rows (``"anchor"``), rounded to 4 digits, for the training log."""
    out = {}
    for p in sorted(set(positions.tolist())):
        sel = (positions == p) & ~anchor
        if sel.any():
            out[str(p)] = round(float(kl[sel].mean()), 4)
    if anchor.any():
        out["anchor"] = round(float(kl[anchor].mean()), 4)
    return out


class _Run:
    """The prepared pieces of one training run and its optimiser step.

    Args: see :func:`train_loop`; ``acc`` is the accelerator the model is prepared with.
    """

    def __init__(self, model, examples, settings, acc, teacher_cache, pad_id):
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        self.settings, self.examples, self.acc = settings, examples, acc
        self.teacher_cache, self.pad_id = teacher_cache, pad_id
        self.r1 = settings.variant == "r1"
        model = wrap_for_training(model, settings)
        self.params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(
            self.params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
        )
        self.steps = total_steps(len(examples), settings)
        self.sched = get_cosine_with_min_lr_schedule_with_warmup(
            opt,
            num_warmup_steps=int(settings.warmup_ratio * self.steps),
            num_training_steps=self.steps,
            min_lr_rate=settings.min_lr_ratio,
        )
        # the scheduler stays unprepared: accelerate would step it once per process
        self.model, self.opt = acc.prepare(model, opt)
        self.order = row_schedule(len(examples), settings)

    def losses(self, chunk: list[Example]) -> torch.Tensor:
        """Per-row loss ``[b]`` of one micro-batch: KL against the teacher (R1) or CE (R2)."""
        batch = collate(chunk, self.pad_id, self.acc.device)
        logits = answer_logits(self.model, batch)
        if self.r1:
            longest = batch["mask"].shape[1]
            teacher = stack_teacher(chunk, self.teacher_cache, longest, self.acc.device)
            return per_sample_kl(teacher, logits, batch["mask"])
        return per_sample_ce(logits, batch["targets"], batch["mask"])

    def weights(self, mine: list[Example], chunks, n_slots: int):
        """Pass 1: this process's row weights ``[len(mine)]`` and, for R1, the gathered
        ``(kl, positions, anchor)`` of the whole effective batch (``None`` for R2, whose rows
        weigh ``1 / n_slots`` each)."""
        from accelerate.utils import gather_object

        device = self.acc.device
        if not self.r1:
            return torch.full((len(mine),), 1.0 / n_slots, device=device), None
        with torch.no_grad():
            kl_mine = torch.cat([self.losses(c) for c in chunks]) if chunks else torch.zeros(0)
        gathered = gather_object(
            [(float(k), e.position, e.anchor) for k, e in zip(kl_mine, mine, strict=True)]
        )
        kl = torch.tensor([g[0] for g in gathered])
        pos = torch.tensor([g[1] for g in gathered])
        anc = torch.tensor([g[2] for g in gathered], dtype=torch.bool)
        w_all = position_weights(kl, pos, anc, self.settings.anchor_weight)
        # gather_object concatenates ranks in order: this rank's slice of the weights
        sizes = gather_object([len(mine)])
        off = sum(sizes[: self.acc.process_index])
        return w_all[off : off + len(mine)].to(device), (kl, pos, anc)

    def accumulate(self, chunks, w_mine: torch.Tensor) -> float:
        """Pass 2: the weighted loss's gradients, accumulated over the micro-batches (synced on
        the last one); returns this process's summed weighted loss."""
        total, at = 0.0, 0
        world = self.acc.num_processes
        for j, c in enumerate(chunks):
            sync = j == len(chunks) - 1
            ctx = contextlib.nullcontext() if sync else self.acc.no_sync(self.model)
            with ctx:
                loss = (w_mine[at : at + len(c)] * self.losses(c)).sum()
                self.acc.backward(loss * world)  # DDP averages over processes: keep the sum
            total += float(loss.detach())
            at += len(c)
        return total

    def step(self, step: int) -> dict:
        """Optimiser step number ``step + 1``; returns its log record (``step``, ``loss``,
        ``lr`` and, for R1, ``kl_by_position``)."""
        from accelerate.utils import gather_object

        s, acc = self.settings, self.acc
        slots = self.order[step * s.effective_batch : (step + 1) * s.effective_batch]
        mine = [self.examples[i] for i in slots[acc.process_index :: acc.num_processes]]
        chunks = [mine[i : i + s.micro_batch] for i in range(0, len(mine), s.micro_batch)]
        w_mine, stats = self.weights(mine, chunks, len(slots))
        total = self.accumulate(chunks, w_mine)
        if s.grad_clip > 0:
            acc.clip_grad_norm_(self.params, s.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        loss = float(sum(gather_object([total])))
        record: dict = {"step": step + 1, "loss": loss, "lr": self.sched.get_last_lr()[0]}
        if stats is not None:
            record["kl_by_position"] = kl_by_position(*stats)
        return record


@contextlib.contextmanager
def _progress(enabled: bool, variant: str, total: int, completed: int) -> Iterator:
    """A rich progress bar; yields ``update(step, record)``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cols = [
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    ]
    with Progress(*cols, disable=not enabled) as bar:
        task = bar.add_task(f"pos2distill {variant}", total=total, completed=completed, info="")

        def update(step: int, record: dict) -> None:
            kl = " ".join(f"{k}:{v:.3f}" for k, v in record.get("kl_by_position", {}).items())
            bar.update(task, completed=step, info=f"loss {record['loss']:.4f}  KL {kl}")

        yield update


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
        model: the initial ``transformers`` causal LM (fp32 or bf16), not yet wrapped; it is
            wrapped by :func:`wrap_for_training`.
        examples: tokenised rows. teacher_cache: question key -> ``[n, V]`` teacher log-probs
            (required for R1, see :func:`~ragfix.distill.batches.teacher_logprobs`).
        out_dir: where the ``checkpoint`` folder and ``train_log.jsonl`` go.
        resume: continue from ``out_dir/checkpoint`` when it exists.
        stop_after: stop after this many steps in this call (a time-boxed run; the checkpoint is
            saved so a rerun continues).
        accelerator: an ``accelerate.Accelerator`` not used for another run (one is made when
            ``None``).

    Returns:
        ``(trained_model, TrainResult)``; the model is unwrapped from accelerate, in eval mode.

    Raises:
        ValueError: R1 without a teacher cache (a bug of the caller).
        ConfigError: a checkpoint from other settings.
    """
    from accelerate import Accelerator

    if settings.variant == "r1" and teacher_cache is None:
        raise ValueError("R1 training needs the teacher's log-probabilities (teacher_cache)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(settings.seed)
    run = _Run(model, examples, settings, acc, teacher_cache, pad_id)
    hook = register_checkpointing(acc, run.sched)
    state = load_checkpoint(acc, out, settings) if resume else None
    step, last_loss = (state["step"], state["loss"]) if state else (0, float("nan"))
    before = state["minutes"] if state else 0.0  # training minutes of the resumed steps
    started, done_here = time.perf_counter(), 0

    def minutes() -> float:
        return before + (time.perf_counter() - started) / 60

    show = show_progress and acc.is_main_process
    with _progress(show, settings.variant, run.steps, step) as update:
        while step < run.steps and (stop_after is None or done_here < stop_after):
            record = run.step(step)
            step, last_loss = step + 1, record["loss"]
            done_here += 1
            if acc.is_main_process:
                with open(out / LOG_FILE, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            update(step, record)
            if step % settings.save_every == 0 or step == run.steps or done_here == stop_after:
                save_checkpoint(acc, out, step, last_loss, settings, minutes())
    hook.remove()
    result = TrainResult(
        steps=step,
        total_steps=run.steps,
        rows=len(examples),
        last_loss=last_loss,
        minutes=minutes(),
        finished=step >= run.steps,
    )
    return acc.unwrap_model(run.model).eval(), result


__all__ = [
    "TrainResult",
    "kl_by_position",
    "row_schedule",
    "total_steps",
    "train_loop",
    "wrap_for_training",
]
