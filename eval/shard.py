"""Scale-out: the same sweep on several processes, GPUs or machines (Hugging Face Accelerate).

Launch with ``accelerate launch`` or ``torchrun``; ragfix starts no launcher of its own. Each
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
