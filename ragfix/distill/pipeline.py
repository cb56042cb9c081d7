"""The whole Pos2Distill run (arXiv 2508.15709): teacher answers -> rows -> teacher log-probs ->
training -> adapter."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ragfix.distill.artefacts import adapter_metadata, save_adapter
from ragfix.distill.batches import Example, answer_token_ids, teacher_logprobs
from ragfix.distill.checkpoint import remove_checkpoint
from ragfix.distill.data import (
    DistillRow,
    TeacherReport,
    build_rows,
    exclude_questions,
    student_prompt,
    teacher_prompt,
)
from ragfix.distill.loop import TrainResult, train_loop
from ragfix.distill.settings import DATA_FILE, TEACHER_FILE, DistillSettings
from ragfix.errors import DataError
from ragfix.io import JsonlStore, atomic_write_json


def teacher_rows(
    teacher,
    candidates: Sequence,
    settings: DistillSettings,
    data_path: Path,
    resume: bool,
    write: bool,
    log: Callable[[str], None],
    model_key: str,
):
    """The kept questions and their rows: reused from ``data_path`` when it was written with the
    same data settings and model from these candidates, else built by :func:`~ragfix.distill.data.
    build_rows` (and written there when ``write``). The teacher's generations are appended to
    :data:`~ragfix.distill.settings.TEACHER_FILE` beside ``data_path`` batch by batch, keyed by
    the model and :meth:`~ragfix.distill.settings.DistillSettings.generation_key`, so an
    interrupted run (``resume``), or a rerun that asks for more or fewer questions, generates only
    what it had not.

    Args:
        model_key: what identifies the teacher's weights (the content fingerprint
            ``model_identity(model)["weights"]``); generations of other weights are never reused.

    Returns:
        ``(kept, rows, report)`` as :func:`~ragfix.distill.data.build_rows`.
    """
    by_id = {s.id: s for s in candidates}
    cached = json.loads(data_path.read_text()) if resume and data_path.exists() else None
    if (
        cached
        and cached["data_key"] == settings.data_key()
        and cached.get("model") == model_key
        and all(i in by_id for i in cached["question_ids"])
    ):
        kept = [by_id[i] for i in cached["question_ids"]]
        rows = [DistillRow(**r) for r in cached["rows"]]
        log(f"reusing {data_path}: {len(kept)} questions, {len(rows)} rows")
        return kept, rows, TeacherReport(**cached["report"])
    # the generations so far by this model under the same prompt settings (an interrupted run,
    # or one that asks for more questions, resumes there)
    key = {**settings.generation_key(), "model": model_key}
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    store = JsonlStore(data_path.parent / TEACHER_FILE, key="key")
    generated = {
        r["sample_id"]: r["text"]
        for r in (store.load().values() if resume else ())
        if r["key"].startswith(f"{tag}:")
    }

    def keep(new: dict[str, str]) -> None:
        for i, text in new.items() if write else ():
            store.append({"key": f"{tag}:{i}", "sample_id": i, "text": text})

    log(
        f"teacher answers at the advantaged position ({len(candidates)} candidates"
        + (f", {len(generated)} generated before)" if generated else ")")
    )
    kept, rows, report = build_rows(
        teacher,
        candidates,
        settings,
        progress=lambda d, t, k: log(f"  tried {d}/{t}, kept {k}/{settings.questions}"),
        generated=generated,
        on_generated=keep,
    )
    if write:
        atomic_write_json(
            data_path,
            {
                "data_key": settings.data_key(),
                "model": model_key,
                "question_ids": [s.id for s in kept],
                "report": report.model_dump(),
                "rows": [r.model_dump() for r in rows],
            },
        )
    return kept, rows, report


def tokenize_rows(teacher, tokenizer, kept: Sequence, rows, settings) -> list[Example]:
    """The rows as token ids: the student prompt as the teacher backend encodes it (chat template
    applied) and the teacher's answer cut to ``max_answer_tokens`` plus EOS."""
    by_id = {s.id: s for s in kept}
    return [
        Example(
            teacher.encode(student_prompt(by_id[r.sample_id], r, settings)),
            answer_token_ids(tokenizer, r.answer, settings.max_answer_tokens),
            r.positions[0],
            r.anchor,
            r.sample_id,
        )
        for r in rows
    ]


def teacher_cache(model, teacher, kept: Sequence, examples, settings) -> dict[str, torch.Tensor]:
    """R1: the frozen initial model's log-probabilities ``[n, V]`` over each question's answer
    tokens on its teacher prompt, computed once per question (before training starts)."""
    answers = {}
    for e in examples:
        answers.setdefault(e.key, e.answer_ids)
    return {
        s.id: teacher_logprobs(
            model,
            Example(teacher.encode(teacher_prompt(s, settings)), answers[s.id], 0, False, s.id),
        )
        for s in kept
    }


def distill(
    model_name: str,
    samples: Sequence,
    settings: DistillSettings,
    out_dir: str | Path,
    excluded: Sequence = (),
    train_files: Sequence[str] = (),
    train_records: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    resume: bool = True,
    stop_after: int | None = None,
    log: Callable[[str], None] = print,
) -> tuple[TrainResult, dict | None]:
    """The whole pipeline: teacher answers -> rows -> teacher log-probs -> training -> adapter.

    The teacher is the initial model as a vanilla :class:`~ragfix.backends.hf.HFBackend` (its
    answers through ``Backend.generate``); the trainer works on the same ``transformers`` model.

    Args:
        model_name: see :func:`ragfix.models.load.load_model`.
        samples: candidate training samples (QA/KV for R1, :class:`MultiHopSample` for R2), tried
            in order until ``settings.questions`` are correct at the advantaged position.
        settings: the run's settings.
        out_dir: the adapter folder; also holds the data cache, the log and the checkpoint.
        excluded: evaluation samples; any training candidate with the same id or question is
            dropped first, and their ids are recorded in the metadata.
        train_files: the data files, recorded in the metadata.
        train_records: the record range of the data files the samples were read from
            (``"0:200"``), recorded in the metadata (None: whole files).
        device, dtype: see :func:`ragfix.models.load.load_model`.
        resume: reuse the data file and continue from the checkpoint of an earlier run.
        stop_after: see :func:`~ragfix.distill.loop.train_loop`.
        log: called with one-line progress messages.

    Returns:
        ``(TrainResult, metadata)``; metadata is ``None`` when the run stopped early.

    Raises:
        ModelNotFoundError: the model cannot be found.
        DataError: no correct teacher answer among the candidates.
        ConfigError: a checkpoint from other settings, or an anchor outside the context.
    """
    from accelerate import Accelerator

    from ragfix.backends.hf import HFBackend
    from ragfix.models.load import load_model, model_identity

    acc = Accelerator(cpu=device == "cpu" or not torch.cuda.is_available())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(model_name, device=str(acc.device), dtype=dtype)
    teacher = HFBackend(model, tok)
    base_identity = model_identity(model)
    candidates = exclude_questions(samples, excluded)
    kept, rows, report = teacher_rows(
        teacher,
        candidates,
        settings,
        out / DATA_FILE,
        resume,
        acc.is_main_process,
        log,
        model_key=base_identity["weights"],
    )
    dropped = {k: v for k, v in report.model_dump().items() if k not in ("tried", "kept") and v}
    why = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in dropped.items()) or "none"
    if not kept:
        where = ", ".join(train_files) or "training samples"
        raise DataError(
            where, None, None, f"no usable teacher answer among {report.tried} questions ({why})"
        )
    log(f"{len(kept)} of {report.tried} teacher answers kept (dropped: {why}); {len(rows)} rows")
    examples = tokenize_rows(teacher, tok, kept, rows, settings)
    cache = None
    if settings.variant == "r1":
        log("teacher log-probabilities (once per question)")
        cache = teacher_cache(model, teacher, kept, examples, settings)
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
    metadata = adapter_metadata(
        settings,
        base_identity,
        kept,
        report,
        len(rows),
        result,
        excluded=excluded,
        excluded_candidates=len(samples) - len(candidates),
        train_files=train_files,
        train_records=train_records,
    )
    if acc.is_main_process:
        save_adapter(trained, out, metadata)
        remove_checkpoint(out)
    return result, metadata


__all__ = ["distill", "teacher_cache", "teacher_rows", "tokenize_rows"]
