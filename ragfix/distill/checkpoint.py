"""Resumable training state of a Pos2Distill run, through ``accelerate``'s checkpointing.

``Accelerator.save_state`` writes the trainable weights, the optimiser, the learning-rate schedule
(registered with ``register_for_checkpointing``) and every process's RNG states; ``load_state``
restores them, so an interrupted ``ragfix distill`` continues exactly where it stopped. A pre-save
hook keeps only the trainable tensors of the model (the LoRA matrices; every weight for full
fine-tuning): the frozen base weights come from the base model on resume.

The state is written to ``checkpoint.tmp`` with :data:`~ragfix.distill.settings.STATE_FILE` (step,
last loss, settings) last, then renamed to ``checkpoint``: a folder holding the state file is
complete, so a crash while saving leaves the previous checkpoint (or a complete ``.tmp`` one).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ragfix.distill.settings import CHECKPOINT_DIR, STATE_FILE, DistillSettings
from ragfix.errors import ConfigError
from ragfix.io import atomic_write_json


def _keep_trainable(models, weights, output_dir) -> None:
    """``accelerate`` pre-save hook: drop the frozen tensors from each model's state dict."""
    for i, model in enumerate(models):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        weights[i] = {k: v for k, v in weights[i].items() if k in trainable}


def register_checkpointing(acc, scheduler):
    """Have ``acc.save_state`` / ``acc.load_state`` cover ``scheduler`` (kept unprepared: a
    prepared one would step once per process) and save only trainable weights.

    Call once per accelerator, after ``acc.prepare(model, optimizer)``.

    Returns:
        the hook handle (``.remove()`` it when training ends).
    """
    acc.register_for_checkpointing(scheduler)
    return acc.register_save_state_pre_hook(_keep_trainable)


def _folders(out_dir: Path) -> tuple[Path, Path]:
    return out_dir / CHECKPOINT_DIR, out_dir / f"{CHECKPOINT_DIR}.tmp"


def save_checkpoint(
    acc, out_dir: str | Path, step: int, loss: float, settings, minutes: float
) -> None:
    """Save the full training state under ``out_dir/checkpoint`` (every process must call it).

    Args:
        acc: the accelerator the model and optimiser were prepared with.
        step: optimiser steps done. loss: the last step's loss. settings: the run's settings.
        minutes: wall-clock training minutes of those steps, over every run that resumed here.
    """
    final, tmp = _folders(Path(out_dir))
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    acc.wait_for_everyone()
    if acc.is_main_process:
        record = {
            "step": step,
            "loss": loss,
            "minutes": minutes,
            "settings": settings.model_dump(mode="json"),
        }
        atomic_write_json(tmp / STATE_FILE, record)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    acc.wait_for_everyone()


def load_checkpoint(acc, out_dir: str | Path, settings: DistillSettings) -> dict | None:
    """Restore the training state saved by :func:`save_checkpoint`, if there is one.

    Returns:
        ``{"step", "loss", "minutes", "settings"}`` of the restored checkpoint (``minutes`` 0.0
        for a checkpoint written before it was recorded), or ``None`` (no checkpoint).

    Raises:
        ConfigError: the checkpoint was written with other settings.
    """
    found = [d for d in _folders(Path(out_dir)) if (d / STATE_FILE).is_file()]
    if not found:
        return None
    where = found[0]
    record = json.loads((where / STATE_FILE).read_text(encoding="utf-8"))
    if record["settings"] != settings.model_dump(mode="json"):
        diff = sorted(
            k for k, v in settings.model_dump(mode="json").items() if record["settings"].get(k) != v
        )
        raise ConfigError(
            f"{where}: checkpoint was written with other settings ({', '.join(diff)}); "
            "remove it or train without resuming"
        )
    acc.load_state(str(where), strict=False)
    return {"minutes": 0.0, **record}


def remove_checkpoint(out_dir: str | Path) -> None:
    """Delete the training state (after the finished adapter is written)."""
    for d in _folders(Path(out_dir)):
        shutil.rmtree(d, ignore_errors=True)


__all__ = ["load_checkpoint", "register_checkpointing", "remove_checkpoint", "save_checkpoint"]
