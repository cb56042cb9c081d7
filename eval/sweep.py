"""The position sweep: every sample with its gold passage at every requested position.

A cell is (sample, gold position, backend, options); its id is a hash of those, so a rerun with
the same ``--out`` skips finished cells (resume after Ctrl-C or a crash) and shards written by
several processes merge by cell id. Results are appended one JSON line per cell, fsynced.

Speed: the cells of one sample share their prompt up to the gold passage. With
``prefix_reuse`` (where the backend supports it) the cells of a sample run from the last position
to the first, and each one reuses the KV cache of the previous one cropped to their common token
prefix (``Backend.generate(..., prefix_reuse=True)``), prefilling only the rest. On a GPU (or with
``batch_size > 1``) cells are batched instead.

The orchestration (reading the data, resuming, sharding, the report) is
:func:`ragfix.eval.run_sweep`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ragfix.backends.base import Backend
from ragfix.errors import ConfigError, DataError
from ragfix.io import JsonlStore, atomic_write_json
from ragfix.tasks import score_answer, task_prompt
from ragfix.types import QASample, SweepRecord

CONFIG_FILE = "config.json"
RESULTS_FILE = "results.jsonl"


class ConfigMismatchError(ConfigError):
    """The output folder holds results of a different configuration."""


class SweepConfig(BaseModel):
    """What makes the results of one output folder comparable (checked on every rerun).

    Frozen: it is hashed into the cell ids. ``limit`` and ``positions`` are not part of it: a
    rerun may add samples or positions.

    Attributes:
        data: the data file (resolved path), or the corpus and question files of a pipeline sweep.
        task: the task (``qa``, ``kv``, ``qa-pipeline``).
        num_docs: passages per prompt.
        model: the model name.
        backend: the backend name.
        backend_options: the options as the user gave them (plus ``adapter`` when one is given).
        distractor_pool: the file distractors were drawn from (raw sweep), or None.
        retrieval: the retriever settings of a pipeline sweep, or None.
    """

    model_config = ConfigDict(frozen=True)

    data: str
    task: str
    num_docs: int
    model: str
    backend: str
    backend_options: dict = Field(default_factory=dict)
    distractor_pool: str | None = None
    retrieval: str | None = None

    def check(self, out: Path) -> bool:
        """Whether ``out/config.json`` exists; if it does, check it matches this configuration.

        Raises:
            ConfigMismatchError: the folder was used for another configuration (names the fields).
            DataError: ``config.json`` is not readable JSON.
        """
        path = out / CONFIG_FILE
        if not path.exists():
            return False
        try:
            theirs = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DataError(path, None, None, f"unreadable run configuration ({e})") from None
        mine = self.model_dump(mode="json")
        diff = [k for k in mine if theirs.get(k) != mine[k]]
        if diff:
            detail = "; ".join(f"{k}: {theirs.get(k)!r} there, {mine[k]!r} now" for k in diff)
            raise ConfigMismatchError(
                f"{out} holds results of another configuration ({detail}); use another --out folder"
            )
        return True

    def write(self, out: Path) -> None:
        """Write ``out/config.json`` (atomically)."""
        atomic_write_json(out / CONFIG_FILE, self.model_dump(mode="json"))


@dataclass(frozen=True)
class Cell:
    """One unit of the sweep: a sample with its gold passage at ``position``."""

    cell_id: str
    sample: QASample
    position: int


def parse_positions(spec: str, num_docs: int) -> list[int]:
    """``"all"``, ``"first,middle,last"`` (any of the three words), or ``"0,4,9"``.

    ``middle`` is ``(num_docs - 1) // 2``.

    Raises:
        ConfigError: an unknown word or a position outside ``0 .. num_docs - 1``.
    """
    if spec.strip() == "all":
        return list(range(num_docs))
    named = {"first": 0, "middle": (num_docs - 1) // 2, "last": num_docs - 1}
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if part in named:
            pos = named[part]
        else:
            try:
                pos = int(part)
            except ValueError:
                raise ConfigError(
                    f"--positions: {part!r} is not 'all', first/middle/last or an integer"
                ) from None
        if not 0 <= pos < num_docs:
            raise ConfigError(f"--positions: {pos} is out of range 0..{num_docs - 1}")
        if pos not in out:
            out.append(pos)
    return out


def cell_id(config: SweepConfig, sample_id: str, position: int) -> str:
    """Deterministic 16-hex id of a cell."""
    key = json.dumps(
        [
            sample_id,
            position,
            config.num_docs,
            config.task,
            config.model,
            config.backend,
            config.backend_options,
        ],
        sort_keys=True,
    )
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def plan_cells(config: SweepConfig, samples: list[QASample], positions: list[int]) -> list[Cell]:
    """All cells, sample-major, positions in the order given."""
    return [Cell(cell_id(config, s.id, p), s, p) for s in samples for p in positions]


def _prompt(cell: Cell):
    return task_prompt(cell.sample, cell.sample.passages_with_gold_at(cell.position))


def _record(cell: Cell, backend: Backend, gen) -> SweepRecord:
    return SweepRecord(
        cell_id=cell.cell_id,
        sample_id=cell.sample.id,
        position=cell.position,
        prompt_position=cell.position,
        num_docs=cell.sample.num_docs,
        backend=backend.name,
        prompt_tokens=gen.prompt_tokens,
        prefill_tokens=gen.prefill_tokens,
        new_tokens=gen.new_tokens,
        answer=gen.text,
        correct=score_answer(cell.sample, gen.text),
        seconds=round(gen.seconds, 4),
    )


def run_cells(
    backend: Backend,
    cells: list[Cell],
    on_record: Callable[[SweepRecord], None],
    prefix_reuse: bool = True,
    batch_size: int = 1,
) -> None:
    """Compute ``cells`` and hand each finished record to ``on_record`` as soon as it is done.

    Args:
        backend: the model backend.
        cells: the cells to compute (already filtered to the unfinished ones).
        on_record: called once per cell, in completion order (e.g. the store's append).
        prefix_reuse: one cell at a time, each sample's cells from the last gold position to the
            first, reusing the KV cache of the shared prompt prefix (only where
            ``backend.supports_prefix_reuse``; otherwise the cells are batched).
        batch_size: cells per forward batch when prefix reuse is off.
    """
    if prefix_reuse and backend.supports_prefix_reuse:
        by_sample: dict[str, list[Cell]] = {}
        for c in cells:
            by_sample.setdefault(c.sample.id, []).append(c)
        for group in by_sample.values():
            for c in sorted(group, key=lambda c: -c.position):
                [gen] = backend.generate([_prompt(c)], prefix_reuse=True)
                on_record(_record(c, backend, gen))
        return
    for start in range(0, len(cells), batch_size):
        chunk = cells[start : start + batch_size]
        gens = backend.generate([_prompt(c) for c in chunk], batch_size=batch_size)
        for c, gen in zip(chunk, gens, strict=True):
            on_record(_record(c, backend, gen))


def open_store(out: Path, rank: int = 0, world_size: int = 1) -> JsonlStore:
    """The result store of ``out``: a single process appends to ``results.jsonl``; rank ``r`` of
    a multi-process run to ``results.rank{r}.jsonl``. Every store reads all of the folder's
    result files, so finished cells are skipped whoever computed them."""
    own = out / (RESULTS_FILE if world_size == 1 else f"results.rank{rank}.jsonl")
    others = sorted(p for p in out.glob("results*.jsonl") if p != own)
    return JsonlStore(own, key="cell_id", read_also=others)
