"""Peak memory and time of one call, for the benchmarks.

On CUDA: the allocator's figures (``torch.cuda.max_memory_allocated``, reset by
``torch.cuda.reset_peak_memory_stats``). On the CPU: the process's peak resident set (``VmHWM``
of ``/proc/self/status``), reset to the current resident set (``VmRSS``) by writing ``5`` to
``/proc/self/clear_refs`` (Linux; run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors
go back to the system and each peak is measured from a clean state). Where the platform has no
such files the figures are ``None``. Sizes are in MiB (``2**20`` bytes).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def status_kib(field: str) -> int | None:
    """The ``field`` of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM`` ...); ``None`` where the
    file cannot be read or has no such field."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return None
    return next((int(x.split()[1]) for x in lines if x.startswith(field + ":")), None)


def reset_peak(device: torch.device) -> None:
    """Start a new peak on ``device``: the CUDA allocator's peak statistics, or on the CPU the
    peak resident set, set to the current one (nothing where ``/proc/self/clear_refs`` cannot be
    written)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            CLEAR_REFS.write_text("5")


def current_mib(device: torch.device) -> float | None:
    """Memory in use now on ``device``: allocated on CUDA, the resident set on the CPU (``None``
    where unknown)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    kib = status_kib("VmRSS")
    return None if kib is None else kib / 1024


def peak_mib(device: torch.device) -> float | None:
    """The peak since the last :func:`reset_peak` (or the start of the process): allocated on
    CUDA, the peak resident set on the CPU (``None`` where unknown)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kib = status_kib("VmHWM")
    return None if kib is None else kib / 1024


def measure(fn: Callable[[], object], device: torch.device) -> tuple[float, float | None]:
    """Run ``fn`` once (garbage collected before; CUDA synchronised before and after).

    Returns:
        ``(wall seconds, peak memory growth in MiB)``: the growth is the peak during the call
        minus the memory in use just before it, at least 0; ``None`` where the platform gives no
        figures.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    reset_peak(device)
    before = current_mib(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = peak_mib(device)
    return seconds, None if peak is None or before is None else max(0.0, peak - before)
