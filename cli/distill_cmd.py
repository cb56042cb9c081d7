"""``ragfix distill r1|r2``: train a Pos2Distill adapter (arXiv 2508.15709).

The adapter folder it writes is a load option of every backend:
``ragfix eval ... --adapter PATH`` (with ``--backend vanilla``, ``gali``, ``channel-scaled`` ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import (
    REQUIRED,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    OptionGroup,
    console,
    user_errors,
)

TrainOpt = Annotated[
    list[Path],
    typer.Option("--train", help="training file (LITM QA or KV JSONL); repeatable"),
]
OutOpt = Annotated[
    Path, typer.Option("--out", "-o", help="adapter folder to write (load it with --adapter PATH)")
]
ExcludeOpt = Annotated[
    list[Path] | None,
    typer.Option("--exclude", help="evaluation file whose questions must not be trained on"),
]
RecordsOpt = Annotated[
    str | None,
    typer.Option(
        help="record range START:END of each training file (0-based, END excluded; record i is "
        "line i+1), before --offset/--candidates; kept in the adapter metadata"
    ),
]
OffsetOpt = Annotated[int, typer.Option(help="skip this many records of each training file")]
CandidatesOpt = Annotated[
    int | None, typer.Option(help="records to try per file (default: all after --offset)")
]
NumDocsOpt = Annotated[int, typer.Option(help="documents per training prompt")]
WordsOpt = Annotated[int | None, typer.Option(help="cut passages to N words (CPU)")]
MaxStepsOpt = Annotated[int | None, typer.Option(help="cap on optimiser steps")]
FullOpt = Annotated[bool, typer.Option(help="train all weights, no LoRA")]
SaveEveryOpt = Annotated[int, typer.Option(help="checkpoint every N steps")]
StopAfterOpt = Annotated[int | None, typer.Option(help="stop after N steps now")]
ResumeOpt = Annotated[bool, typer.Option(help="continue from the checkpoint")]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch CPU threads")]

#: the options of both variants (``r1``, ``r2``): data, training loop, checkpoints, machine
TRAINING_OPTIONS = OptionGroup(
    "training",
    train=(TrainOpt, REQUIRED),
    out=(OutOpt, REQUIRED),
    model=(ModelOpt, "smollm2"),
    exclude=(ExcludeOpt, None),
    records=(RecordsOpt, None),
    offset=(OffsetOpt, 0),
    candidates=(CandidatesOpt, None),
    num_docs=(NumDocsOpt, 10),
    max_passage_words=(WordsOpt, None),
    epochs=(int, 1),
    max_steps=(MaxStepsOpt, None),
    effective_batch=(int, 32),
    micro_batch=(int, 1),
    lr=(float, 1e-4),
    lora_r=(int, 16),
    lora_alpha=(int, 32),
    full_finetune=(FullOpt, False),
    save_every=(SaveEveryOpt, 10),
    stop_after=(StopAfterOpt, None),
    resume=(ResumeOpt, True),
    seed=(int, 42),
    threads=(ThreadsOpt, None),
    device=(DeviceOpt, "auto"),
    dtype=(DtypeOpt, "auto"),
)


def _load(
    files: list[Path],
    num_docs: int,
    offset: int,
    candidates: int | None,
    max_words: int | None,
    records: slice | None = None,
):
    """The training samples of every file: the records of ``records`` (all when None), then
    ``offset`` skipped and ``candidates`` kept, passages cut to ``max_words``."""
    from ragfix.connectors.jsonl import SkipCounter
    from ragfix.connectors.litm import load_samples
    from ragfix.distill import shorten_sample

    out = []
    for f in files:
        limit = None if candidates is None else offset + candidates
        skipped = SkipCounter()
        loaded = load_samples(
            f, num_docs, limit, skip_invalid=True, skipped=skipped, records=records
        )
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


def _train(
    train: list[Path],
    out: Path,
    model: str,
    exclude: list[Path] | None,
    records: str | None,
    offset: int,
    candidates: int | None,
    threads: int | None,
    device: str,
    dtype: str,
    resume: bool,
    stop_after: int | None,
    **settings,
) -> None:
    """Load the data, run :func:`ragfix.distill.distill` and print the outcome."""
    import torch

    from ragfix.connectors.records import format_records, parse_records
    from ragfix.distill import DistillSettings, compose_two_passage, distill
    from ragfix.errors import ConfigError

    if threads:
        torch.set_num_threads(threads)
    rng = parse_records(records) if records is not None else None
    cfg = DistillSettings(**settings)
    samples = _load(train, cfg.num_docs, offset, candidates, cfg.max_passage_words, rng)
    excluded = _excluded(exclude)
    if cfg.variant == "r2":
        samples = compose_two_passage(samples, cfg.num_docs, excluded)
    if not samples:
        raise ConfigError("no training questions left (check --records / --offset / --candidates)")
    result, meta = distill(
        model,
        samples,
        cfg,
        out,
        excluded=excluded,
        train_files=[str(f) for f in train],
        train_records=format_records(rng) if rng else None,
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
        f"final loss {result.last_loss:.4f}",
        highlight=False,
    )
    console.print(f"evaluate it with: ragfix eval ... --adapter {out}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add the ``distill`` command group to ``app``."""
    distill_app = typer.Typer(
        help="Train a Pos2Distill adapter (position-to-position self-distillation); "
        "evaluate it with `ragfix eval ... --adapter PATH`.",
        no_args_is_help=True,
    )
    app.add_typer(distill_app, name="distill")

    @distill_app.command("r1")
    @TRAINING_OPTIONS
    def r1(
        questions: Annotated[int, typer.Option(help="correct teacher answers to keep")] = 300,
        positions_per_question: Annotated[int, typer.Option(help="K trivial positions")] = 4,
        max_answer_words: Annotated[
            int, typer.Option(help="QA: drop teacher answers longer than N words")
        ] = 12,
        anchor_position: Annotated[int, typer.Option(help="sink position, 0-based; -1 last")] = 0,
        anchor_weight: Annotated[float, typer.Option(help="lambda of the anchoring term")] = 1.0,
        training: dict | None = None,
    ) -> None:
        """R1 (retrieval): KL from the model at its advantaged position to every other one."""
        with user_errors():
            _train(
                **training,
                variant="r1",
                max_answer_words=max_answer_words,
                questions=questions,
                positions_per_question=positions_per_question,
                anchor_position=anchor_position,
                anchor_weight=anchor_weight,
            )

    @distill_app.command("r2")
    @TRAINING_OPTIONS
    def r2(
        questions: Annotated[int, typer.Option(help="correct teacher answers to keep")] = 500,
        positions_per_question: Annotated[int, typer.Option(help="K position pairs")] = 4,
        max_new_tokens: Annotated[int, typer.Option(help="chain-of-thought budget")] = 160,
        training: dict | None = None,
    ) -> None:
        """R2 (reasoning): cross-entropy on the chain of thought sampled with both gold passages
        last, from other position pairs. Multi-hop questions are composed from pairs of NQ
        questions of the training files (two gold passages, both answers required)."""
        with user_errors():
            _train(
                **training,
                variant="r2",
                questions=questions,
                positions_per_question=positions_per_question,
                r2_max_new_tokens=max_new_tokens,
            )
