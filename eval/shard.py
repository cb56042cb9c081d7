"""Scale-out: the same sweep on several processes, GPUs or machines (Hugging Face Accelerate).

Launch with ``accelerate launch`` or ``torchrun`` for GPUs and machines. On one CPU machine the
sweep starts its own worker processes (:func:`sweep_workers`: one single-thread process per free
core, ``ragfix eval --workers N``), which split the cells the same way. Each
rank reads the data itself, loads the model on its own device (``PartialState().device``),
takes its share of the unfinished cells and appends to its own ``results.rank{r}.jsonl``. Work is
split by whole samples (so the KV-cache prefix reuse across positions keeps working), balanced by
prompt length with a longest-first greedy assignment that every rank computes identically from
the deterministic cell ids. Rank 0, or any later run, merges the shards by cell id.

Sharding by job (``--shard i/N`` on every run kind, :class:`Shard`): N independent launches (a
SLURM array, a shell loop, N machines), each computing a disjoint slice of the run's cells into
its own file of one shared folder or of its own folder. A job's slice is split from *all* of the
run's cells with the same balanced split as the ranks (:meth:`ragfix.eval.run.RunKind.split`),
so a rerun of shard i finds the same cells whatever the other jobs did; the ranks of a launcher
split what is left to do. :func:`ragfix.eval.merge.merge_runs` checks that the shards ran one
configuration and cover every cell, then writes one run folder; the same command without
``--shard`` over it writes the summary.

On a machine without a GPU, ``PartialState`` joins the process group only when created with
``cpu=True`` (gloo); without it every process believes it is alone and computes everything
(checked with accelerate 1.15 under torchrun), so :func:`distributed_state` passes it.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from ragfix.errors import ConfigError
from ragfix.io import JsonlStore, atomic_write_json, atomic_write_text

T = TypeVar("T")


#: environment variable with the default number of sweep worker processes (``--workers``)
WORKERS_ENV = "RAGFIX_WORKERS"


def threads_per_worker() -> int:
    """Torch threads of each sweep worker process: ``$RAGFIX_THREADS`` (``ragfix --threads N``),
    else 1.

    Raises:
        ConfigError: ``$RAGFIX_THREADS`` is not a whole number of at least 1.
    """
    from ragfix.models.device import THREADS_ENV, cpu_threads

    return cpu_threads() if os.environ.get(THREADS_ENV) else 1


def sweep_workers(workers: int | None, *, device: str, model: str, samples: int) -> int:
    """How many worker processes a sweep runs in, each on its share of whole samples.

    On the CPU, single-thread processes side by side do more cells per second than one process
    whose threads share the cores (``ragfix bench processes``; ``results/cpu-threads.json``). The
    default (``workers`` and ``$RAGFIX_WORKERS`` unset) is therefore, for a local model on the CPU
    and outside a launcher: the free cores (:func:`ragfix.models.device.free_cpu_cores`) divided by
    the threads per process (:func:`threads_per_worker`), at most one process per sample,
    and at most as many as the available memory holds at twice the weight files' size each (fp32
    copies of half-precision files); one process on CUDA, for a served model, or when the weights'
    size is unknown.

    Args:
        workers: an explicit count (``--workers``), or ``None`` for the default.
        device: the sweep's device (``"auto"``, ``"cpu"``, ``"cuda"`` ...).
        model: the model name (see :func:`ragfix.models.resolve.resolve_model`).
        samples: samples with cells still to compute.

    Raises:
        ConfigError: a count below 1 or not a whole number, or more than one worker on CUDA,
            for a served model, or under a launcher.
    """
    import psutil

    from ragfix.errors import ConfigError
    from ragfix.models.device import free_cpu_cores, resolve_device, whole_number
    from ragfix.models.resolve import resolve_model, weights_bytes

    raw = workers if workers is not None else os.environ.get(WORKERS_ENV)
    local_cpu = (
        resolve_device(device).type == "cpu"
        and resolve_model(model).source != "remote"
        and world_size_from_env() == 1
    )
    if raw is not None:
        n = whole_number(raw, WORKERS_ENV, "worker processes")
        if n < 1:
            raise ConfigError(f"--workers {n}: give at least 1")
        if n > 1 and not local_cpu:
            raise ConfigError(
                f"--workers {n}: worker processes are for a local model on the CPU; on GPUs or "
                "machines use accelerate launch / torchrun, for a served model --concurrency"
            )
        return min(n, max(1, samples))  # a worker without a sample would only load the model
    if not local_cpu:
        return 1
    size = weights_bytes(model)
    if size is None:
        return 1
    fits = psutil.virtual_memory().available // (2 * size)
    return max(1, min(free_cpu_cores() // threads_per_worker(), samples, fits))


def world_size_from_env() -> int:
    """``WORLD_SIZE`` set by torchrun / accelerate launch (1 when absent)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed_state():
    """The Accelerate ``PartialState`` of this process (gloo on CPU-only machines), or None when
    the process was not started by a launcher."""
    if world_size_from_env() <= 1:
        return None
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def assign_groups(
    groups: Sequence[T], weights: Sequence[float], keys: Sequence[str], world_size: int
) -> list[list[T]]:
    """Split ``groups`` over ``world_size`` ranks, balanced by ``weights``.

    Longest-processing-time-first: groups sorted by weight (descending, ties by key) each go to
    the rank with the least total weight so far (ties to the lowest rank). Deterministic: every
    rank computes the same split from the same inputs.

    Returns:
        ``world_size`` lists of groups (rank r gets element r).
    """
    order = sorted(range(len(groups)), key=lambda i: (-weights[i], keys[i]))
    heap = [(0.0, r) for r in range(world_size)]
    out: list[list[T]] = [[] for _ in range(world_size)]
    for i in order:
        load, r = heapq.heappop(heap)
        out[r].append(groups[i])
        heapq.heappush(heap, (load + weights[i], r))
    return out


def merge_shards(out: Path, results_file: str = "results.jsonl", key: str = "cell_id") -> int:
    """Merge the result files of ``out`` (``results.rank{r}.jsonl`` of a launcher's ranks,
    ``results.shard{i}of{N}.jsonl`` of jobs) into one ``results.jsonl`` (first record per key,
    torn lines dropped), written atomically; the other files are then removed.

    Returns:
        the number of records in the merged file.
    """
    main = out / results_file
    shards = _other_result_files(out, results_file)
    records = JsonlStore(main, key=key, read_also=shards).load()
    if shards or main.exists():
        replace_results(out, results_file, records)
    return len(records)


def _other_result_files(out: Path, results_file: str) -> list[Path]:
    """The result files of ``out`` beside ``results_file`` (``results.*.jsonl``)."""
    stem, _, suffix = results_file.rpartition(".")
    return sorted(p for p in out.glob(f"{stem}.*.{suffix}") if p != out / results_file)


def replace_results(out: Path, results_file: str, records: dict[str, dict]) -> None:
    """Write ``records`` as ``out/results_file`` (atomically), then remove the folder's other
    result files (:func:`_other_result_files`)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records.values())
    atomic_write_text(out / results_file, text)
    for p in _other_result_files(out, results_file):
        p.unlink()


#: a job shard's manifest in its run folder: ``shard{i}of{N}.json``
SHARD_MANIFEST = "shard{index}of{count}.json"


@dataclass(frozen=True)
class Shard:
    """Job ``index`` of ``count`` (0-based: ``--shard 0/4`` to ``--shard 3/4``, as a SLURM array
    ``--array=0-3`` numbers its tasks).

    Raises:
        ConfigError: ``count`` < 1 or ``index`` outside ``0 .. count-1``.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(
                f"--shard {self.index}/{self.count}: give I/N with N >= 1 and 0 <= I < N "
                "(0-based, as a SLURM array's task ids)"
            )

    @classmethod
    def parse(cls, text: str | Shard | None) -> Shard | None:
        """``"i/N"`` to a shard; a shard or ``None`` stays as it is.

        Raises:
            ConfigError: not two whole numbers ``I/N``, or out of range.
        """
        if text is None or isinstance(text, Shard):
            return text
        head, sep, tail = str(text).partition("/")
        if not sep or not head.strip().isdigit() or not tail.strip().isdigit():
            raise ConfigError(f"--shard {text!r}: give I/N, e.g. 0/4 (0-based)")
        return cls(int(head), int(tail))

    @property
    def tag(self) -> str:
        """``shard{i}of{N}``: the infix of this job's result file and its manifest's name."""
        return f"shard{self.index}of{self.count}"

    def manifest(self, out: Path) -> Path:
        """This job's manifest in ``out``."""
        return Path(out) / SHARD_MANIFEST.format(index=self.index, count=self.count)

    def own_file(self, own: str) -> str:
        """The result file this job appends to, from the one it would append to unsharded
        (``results.jsonl`` to ``results.shard0of4.jsonl``; a rank's
        ``results.rank1.jsonl`` to ``results.shard0of4.rank1.jsonl``)."""
        stem, _, rest = own.partition(".")
        return f"{stem}.{self.tag}.{rest}"


def shard_manifests(folder: str | Path) -> list[Path]:
    """The job shard manifests (``shard{i}of{N}.json``) in ``folder``, sorted."""
    return sorted(Path(folder).glob(SHARD_MANIFEST.format(index="*", count="*")))


def plan_fingerprint(cell_ids: Sequence[str]) -> str:
    """A fingerprint of a run's whole list of cell ids, in order: every shard of one run records
    the same one."""
    return hashlib.sha256("\n".join(cell_ids).encode()).hexdigest()[:16]


def write_manifest(
    out: Path, shard: Shard, *, results: str, key: str, cells: Sequence[str], mine: Sequence[str]
) -> None:
    """Write ``shard``'s manifest into ``out`` (atomically): the run's result file name and key,
    its number of cells and :func:`plan_fingerprint`, and the ids of this job's cells."""
    atomic_write_json(
        shard.manifest(out),
        {
            "shard": shard.index,
            "of": shard.count,
            "results": results,
            "key": key,
            "cells": len(cells),
            "plan": plan_fingerprint(cells),
            "assigned": list(mine),
        },
    )
