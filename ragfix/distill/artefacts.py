"""The artefact of a Pos2Distill run: the trained adapter (peft LoRA files, or the full weights)
and ``ragfix_adapter.json``, in the format :func:`ragfix.lora.load_adapter` reads."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from ragfix.io import atomic_write_json
from ragfix.lora import FORMAT, FULL_WEIGHTS_FILE, METADATA_FILE


def adapter_metadata(
    settings,
    base_identity: dict,
    kept: list,
    report,
    rows: int,
    result,
    excluded=(),
    excluded_candidates: int = 0,
    train_files=(),
    train_records: str | None = None,
) -> dict:
    """The metadata of a finished run (:data:`~ragfix.lora.METADATA_FILE`).

    Args:
        settings: the :class:`~ragfix.distill.settings.DistillSettings`.
        base_identity: :func:`ragfix.models.load.model_identity` of the base model (checked on
            load).
        kept: the training questions. report: the
            :class:`~ragfix.distill.data.TeacherReport` (questions tried, kept, dropped and
            why). rows: training rows.
        result: the :class:`~ragfix.distill.loop.TrainResult`.
        excluded: evaluation samples kept out of training (their ids are recorded).
        excluded_candidates: training candidates dropped because they were among ``excluded``.
        train_files: the data files.
        train_records: the record range of every training file (``"0:200"``; None: whole
            files), so an evaluation can be run on a disjoint range.
    """
    return {
        "format": FORMAT,
        "version": 1,
        "kind": "full" if settings.full_finetune else "lora",
        "variant": settings.variant,
        "base_model": base_identity,
        "train_files": list(train_files),
        "train_records": train_records,
        "train_question_ids": [s.id for s in kept],
        "train_questions": [s.question for s in kept],
        "questions_tried": report.tried,
        "teacher_answers": report.model_dump(),
        "excluded_question_ids": sorted({s.id for s in excluded}),
        "excluded_candidates": excluded_candidates,
        "rows": rows,
        "steps": result.steps,
        "final_loss": result.last_loss,
        "train_minutes": round(result.minutes, 2),
        "settings": settings.model_dump(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def save_adapter(model, out_dir: str | Path, metadata: dict) -> Path:
    """Write the trained adapter (peft files, or the full weights) and ``ragfix_adapter.json``.

    The old metadata is removed first and the new one written last (atomically), so a folder with
    a metadata file always holds complete weights.

    Args:
        model: the trained peft model (``metadata["kind"] == "lora"``) or the fully fine-tuned
            ``transformers`` model (``"full"``; tied output weights are not stored).
        out_dir: the adapter folder (created if needed).
        metadata: see :func:`adapter_metadata`; needs ``format``, ``kind`` and ``base_model``.

    Returns:
        the metadata path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / METADATA_FILE).unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".adapter-"))
    try:
        if metadata["kind"] == "full":
            from safetensors.torch import save_file

            state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
            if getattr(model.config, "tie_word_embeddings", False):
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


__all__ = ["adapter_metadata", "save_adapter"]
