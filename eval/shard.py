"""Scale-out: the same sweep on several processes, GPUs or machines (Hugging Face Accelerate).

Launch with ``accelerate launch`` or ``torchrun`` for GPUs and machines. On one CPU machine the
sweep starts its own worker processes (:func:`sweep_workers`: one single-thread process per free
core, ``ragfix eval --workers N``), which split the cells the same way. Each
rank reads the data itself, loads the model on its own device (``PartialState().device``),
takes its share of the unfinished cells and appends to its own ``results.rank{r}.jsonl``. Work is
split by whole samples (so the KV-cache prefix reuse across positions keeps working), balanced by
prompt length with a longest-first greedy assignment that every rank computes identically from
the deterministic cell ids. Rank 0, or any later run, merges the shards by cell id.

On a machine without a GPU, ``PartialState`` joins the process group only when created with
``cpu=True`` (gloo); without it every process believes it is alone and computes everything
(checked with accelerate 1.15 under torchrun), so :func:`distributed_state` passes it.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from ragfix.io import JsonlStore, atomic_write_text

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
    """Merge ``results*.jsonl`` of ``out`` into one ``results.jsonl`` (first record per key,
    torn lines dropped), written atomically; the rank shards are then removed.

    Returns:
        the number of records in the merged file.
    """
    import json

    main = out / results_file
    shards = sorted(p for p in out.glob("results.rank*.jsonl"))
    records = JsonlStore(main, key=key, read_also=shards).load()
    if shards or main.exists():
        atomic_write_text(
            main, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records.values())
        )
    for p in shards:
        p.unlink()
    return len(records)
