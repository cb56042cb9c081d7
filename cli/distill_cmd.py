"""``ragfix distill r1|r2``: train a Pos2Distill adapter (arXiv 2508.15709)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import DeviceOpt, DtypeOpt, ModelOpt, UserError, console, user_errors

TrainOpt = Annotated[
    list[Path],
    typer.Option("--train", help="training file (LITM QA or KV JSONL); repeatable"),
]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="adapter folder to write")]
ExcludeOpt = Annotated[
    list[Path] | None,
    typer.Option("--exclude", help="evaluation file whose questions must not be trained on"),
]
OffsetOpt = Annotated[int, typer.Option(help="skip this many records of each training file")]
CandidatesOpt = Annotated[
    int | None, typer.Option(help="records to try per file (default: all after --offset)")
]


def _load(
    files: list[Path], num_docs: int, offset: int, candidates: int | None, max_words: int | None
):
    from ragfix.connectors.jsonl import SkipCounter
    from ragfix.connectors.litm import load_samples
    from ragfix.distill import shorten_sample

    out = []
    for f in files:
        limit = None if candidates is None else offset + candidates
        skipped = SkipCounter()
        loaded = load_samples(f, num_docs, limit, skip_invalid=True, skipped=skipped)
        out += [shorten_sample(s, max_words) for s in loaded[offset:]]
        if skipped.count:
            console.print(
                f"[yellow]{f}: skipped {skipped.count} unusable record(s)[/yellow]; first: "
                f"{skipped.examples[0]}",
                highlight=False,
            )
    return out


def _excluded(files: list[Path] | None):
    from ragfix.connectors.litm import load_samples

    return [s for f in files or [] for s in load_samples(f, 1)]


def _run(samples, settings, out, excluded, train, model, device, dtype, resume, stop_after):
    from ragfix.distill import distill

    if not samples:
        raise UserError("no training questions left (check --offset / --candidates)")
    result, meta = distill(
        model,
        samples,
        settings,
        out,
        excluded=excluded,
        train_files=[str(f) for f in train],
        device=device,
        dtype=dtype,
        resume=resume,
        stop_after=stop_after,
        log=lambda m: console.print(m, highlight=False),
    )
    if meta is None:
        console.print(
            f"stopped after step {result.steps}/{result.total_steps} ({result.minutes:.1f} min); "
            "rerun the same command to continue"
        )
        return
    console.print(
        f"adapter written to {out}: {len(meta['train_question_ids'])} questions, "
        f"{meta['rows']} rows, {result.steps} steps, {result.minutes:.1f} min, "
        f"final loss {result.last_loss:.4f}"
    )


def register(app: typer.Typer) -> None:
    """Add the ``distill`` command group to ``app``."""
    distill_app = typer.Typer(
        help="Train a Pos2Distill adapter (position-to-position self-distillation).",
        no_args_is_help=True,
    )
    app.add_typer(distill_app, name="distill")

    @distill_app.command("r1")
    def r1(
        train: TrainOpt,
        out: OutOpt,
        model: ModelOpt = "smollm2",
        exclude: ExcludeOpt = None,
        offset: OffsetOpt = 0,
        candidates: CandidatesOpt = None,
        questions: Annotated[int, typer.Option(help="correct teacher answers to keep")] = 300,
        num_docs: Annotated[int, typer.Option(help="documents per training prompt")] = 10,
        max_passage_words: Annotated[int | None, typer.Option(help="cut passages (CPU)")] = None,
        positions_per_question: Annotated[int, typer.Option(help="K trivial positions")] = 4,
        anchor_position: Annotated[int, typer.Option(help="sink position, 0-based; -1 last")] = 0,
        anchor_weight: Annotated[float, typer.Option(help="lambda of the anchoring term")] = 1.0,
        epochs: int = 1,
        max_steps: Annotated[int | None, typer.Option(help="cap on optimiser steps")] = None,
        effective_batch: int = 32,
        micro_batch: int = 1,
        lr: float = 1e-4,
        lora_r: int = 16,
        lora_alpha: int = 32,
        full_finetune: Annotated[bool, typer.Option(help="train all weights, no LoRA")] = False,
        save_every: Annotated[int, typer.Option(help="checkpoint every N steps")] = 10,
        stop_after: Annotated[int | None, typer.Option(help="stop after N steps now")] = None,
        resume: Annotated[bool, typer.Option(help="continue from the checkpoint")] = True,
        seed: int = 42,
        threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """R1 (retrieval): KL from the model at its advantaged position to every other one."""
        with user_errors():
            import torch

            from ragfix.distill import DistillSettings

            if threads:
                torch.set_num_threads(threads)
            settings = DistillSettings(
                variant="r1",
                num_docs=num_docs,
                max_passage_words=max_passage_words,
                questions=questions,
                positions_per_question=positions_per_question,
                anchor_position=anchor_position,
                anchor_weight=anchor_weight,
                epochs=epochs,
                max_steps=max_steps,
                effective_batch=effective_batch,
                micro_batch=micro_batch,
                lr=lr,
                lora_r=lora_r,
                lora_alpha=lora_alpha,
                full_finetune=full_finetune,
                save_every=save_every,
                seed=seed,
            )
            samples = _load(train, num_docs, offset, candidates, max_passage_words)
            excluded = _excluded(exclude)
            _run(samples, settings, out, excluded, train, model, device, dtype, resume, stop_after)

    @distill_app.command("r2")
    def r2(
        train: TrainOpt,
        out: OutOpt,
        model: ModelOpt = "smollm2",
        exclude: ExcludeOpt = None,
        offset: OffsetOpt = 0,
        candidates: CandidatesOpt = None,
        questions: Annotated[int, typer.Option(help="correct teacher answers to keep")] = 500,
        num_docs: Annotated[int, typer.Option(help="documents per training prompt")] = 10,
        max_passage_words: Annotated[int | None, typer.Option(help="cut passages (CPU)")] = None,
        positions_per_question: Annotated[int, typer.Option(help="K position pairs")] = 4,
        max_new_tokens: Annotated[int, typer.Option(help="chain-of-thought budget")] = 160,
        epochs: int = 1,
        max_steps: Annotated[int | None, typer.Option(help="cap on optimiser steps")] = None,
        effective_batch: int = 32,
        micro_batch: int = 1,
        lr: float = 1e-4,
        lora_r: int = 16,
        lora_alpha: int = 32,
        full_finetune: Annotated[bool, typer.Option(help="train all weights, no LoRA")] = False,
        save_every: Annotated[int, typer.Option(help="checkpoint every N steps")] = 10,
        stop_after: Annotated[int | None, typer.Option(help="stop after N steps now")] = None,
        resume: Annotated[bool, typer.Option(help="continue from the checkpoint")] = True,
        seed: int = 42,
        threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
        device: DeviceOpt = "auto",
        dtype: DtypeOpt = "auto",
    ) -> None:
        """R2 (reasoning): cross-entropy on the chain of thought sampled with both gold passages
        last, from other position pairs. Multi-hop questions are composed from pairs of NQ
        questions of the training files (two gold passages, both answers required)."""
        with user_errors():
            import torch

            from ragfix.distill import DistillSettings, compose_two_passage

            if threads:
                torch.set_num_threads(threads)
            settings = DistillSettings(
                variant="r2",
                num_docs=num_docs,
                max_passage_words=max_passage_words,
                questions=questions,
                positions_per_question=positions_per_question,
                r2_max_new_tokens=max_new_tokens,
                epochs=epochs,
                max_steps=max_steps,
                effective_batch=effective_batch,
                micro_batch=micro_batch,
                lr=lr,
                lora_r=lora_r,
                lora_alpha=lora_alpha,
                full_finetune=full_finetune,
                save_every=save_every,
                seed=seed,
            )
            singles = _load(train, num_docs, offset, candidates, max_passage_words)
            if any(s.task != "qa" for s in singles):
                raise UserError("r2 composes two-passage questions from QA files, not KV files")
            samples = compose_two_passage(singles, num_docs)
            excluded = _excluded(exclude)
            if excluded:
                from ragfix.distill import exclude_questions

                keep = {s.id for s in exclude_questions(singles, excluded)}
                samples = [m for m in samples if all(p in keep for p in m.id.split("+"))]
            _run(samples, settings, out, excluded, train, model, device, dtype, resume, stop_after)
