"""Where and how a model runs: the device, the dtype and torch's CPU threads (from the cores this
process may use and those other processes keep busy). torch is imported by the functions that
need it, so the thread settings (:data:`THREADS_ENV`, :func:`usable_cpu_cores`) import light."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ragfix.errors import ConfigError

if TYPE_CHECKING:
    import torch


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` gives CUDA when available, else CPU; any other string is passed to torch."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


#: environment variable read by :func:`cpu_threads` (``ragfix --threads N`` sets it)
THREADS_ENV = "RAGFIX_THREADS"


def exit_with_parent() -> None:
    """In a child process (``multiprocessing``, any start method): end it with ``os._exit(1)``
    as soon as its parent is gone (killed by a signal, ``kill -9`` or out of memory), so no
    orphan keeps computing or writing after the job that started it. A daemon thread waits on
    the parent's sentinel; in a process without a ``multiprocessing`` parent this does nothing."""
    import multiprocessing
    import threading
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="ragfix-parent-watch", daemon=True).start()


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :mod:`subprocess` that ends the child with SIGTERM when the process
    that started it ends, however it ends (Linux ``prctl(PR_SET_PDEATHSIG)``); a child whose
    parent was already gone exits at once. ``None`` (no effect) on other systems. For
    ``multiprocessing`` children, :func:`exit_with_parent`."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def preexec() -> None:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def usable_cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return usable or 1


def free_cpu_cores() -> int:
    """Cores this process may use (its CPU affinity) less the cores other processes keep busy
    now: their CPU use on those cores over half a second (psutil), in cores, rounded; at least 1.
    So on a machine another job keeps busy, a model process does not ask for cores it would fight
    over. A sample of the present rather than the 1-minute load average, which still counts a
    run that has just ended (a sweep started right after another one, or after ``pip install``).
    """
    import psutil

    busy = psutil.cpu_percent(interval=0.5, percpu=True)
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(len(busy))
    used = sum(busy[i] for i in cpus if i < len(busy)) / 100
    return max(1, usable_cpu_cores() - round(used))


def whole_number(raw: int | str, env: str, what: str) -> int:
    """``raw`` (a count given in code, or the text of the environment variable ``env``) as an
    int.

    Raises:
        ConfigError: not a whole number (``env`` and the value named).
    """
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{env}={raw!r}: expected a whole number of {what}") from None


def cpu_threads(threads: int | None = None) -> int:
    """Set torch's intra-op CPU threads and return the number set.

    PyTorch starts one thread per core; when other processes hold some of the cores, its threads
    wait on each other at every parallel step and a model process slows several-fold (measured in
    ``results/cpu-threads.json``, ``ragfix bench threads``). The number comes from,
    in order: ``threads``; ``$RAGFIX_THREADS`` (``ragfix --threads N``); ``$OMP_NUM_THREADS``
    (then torch's own setting is kept); otherwise :func:`free_cpu_cores`.

    Raises:
        ConfigError: a thread count below 1 or not an integer.
    """
    import torch

    raw = threads if threads is not None else os.environ.get(THREADS_ENV)
    if raw is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        raw = free_cpu_cores()
    n = whole_number(raw, THREADS_ENV, "threads")
    if n < 1:
        raise ConfigError(f"threads={n}: expected at least 1")
    torch.set_num_threads(n)
    return n


def cpu_bf16_kernels() -> str | None:
    """The CPU instructions that oneDNN's bf16 matrix kernels run on here: ``"amx"`` (AMX
    tiles), ``"avx512_bf16"``, or ``None`` (bf16 is emulated: slower than float32)."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        return "amx"
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    return None


def auto_dtype_line() -> str:
    """What ``--dtype auto`` picks on this machine and why, in one line (``ragfix models``)."""
    import torch

    if torch.cuda.is_available():
        return "dtype auto: bfloat16 (CUDA)"
    kernels = cpu_bf16_kernels()
    why = (
        f"the CPU has bf16 kernels ({kernels}), but bf16 answers differ from float32's "
        "(docs/results.md#bf16-on-the-cpu); --dtype bfloat16 to use them"
        if kernels
        else "the CPU has no bf16 kernels (no AMX, no avx512_bf16): bf16 would be emulated"
    )
    return f"dtype auto: float32 (CPU): {why}"


#: the dtypes a model may be loaded in, by name (``"auto"`` too)
DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(dtype: str) -> str:
    """``dtype`` as given, when it is ``"auto"`` or a name in :data:`DTYPES`.

    Raises:
        ConfigError: any other name (the valid ones named).
    """
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: expected auto, {', '.join(DTYPES)}")
    return dtype


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None):
    """``"auto"``: bfloat16 on CUDA, float32 elsewhere; a name of :data:`DTYPES`; or a torch
    dtype as it is.

    Raises:
        ConfigError: a name that is not ``"auto"`` or one of :data:`DTYPES`.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if check_dtype(dtype) == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def dtype_axis(dtypes: Sequence[str], device: torch.device) -> list[str]:
    """A benchmark's dtype axis: each of ``dtypes`` resolved on ``device``
    (:func:`resolve_dtype`) and named without ``torch.`` (``["float32", "bfloat16"]``).

    Raises:
        ConfigError: an unknown dtype, or one named twice (``auto`` and what it picks too).
    """
    names = [str(resolve_dtype(d, device)).removeprefix("torch.") for d in dtypes]
    if len(set(names)) < len(names):
        raise ConfigError(f"--dtype {','.join(dtypes)}: a dtype is named twice ({names})")
    return names


#: the name of :mod:`ragfix.models.attention`'s implementation (SDPA, decoding steps in float32)
SDPA_FP32_DECODE = "sdpa_fp32_decode"
#: the name of :mod:`ragfix.models.attention`'s banded implementation (sliding-window layers'
#: prefill in blocks of rows, decoding steps as :data:`SDPA_FP32_DECODE`'s)
SDPA_BANDED = "sdpa_banded"


def half_on_cpu(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether weights of ``dtype`` on ``device`` are bf16 or fp16 on the CPU, where SDPA's
    one-row kernel is slow and a row's rounding depends on what else is in its batch."""
    import torch

    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def layer_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer of a model config (a text config is taken from a multimodal one), its
    sliding window in tokens, or ``None`` for a full layer (transformers'
    ``get_layer_types_and_kwargs``: Mistral slides every layer, Gemma 3 five of six)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return tuple(
        int(kw["sliding_window"]) if t == "sliding_attention" and kw.get("sliding_window") else None
        for t, kw in zip(types, kwargs, strict=True)
    )


def slides(windows: tuple[int | None, ...]) -> bool:
    """Whether any layer of :func:`layer_windows` slides a window."""
    return any(w is not None for w in windows)


def default_attention(device: torch.device, dtype: torch.dtype, sliding: bool = False) -> str:
    """The attention implementation :func:`~ragfix.models.load.load_model` uses when none is
    asked for (:mod:`ragfix.models.attention`): on the CPU, :data:`SDPA_BANDED` for a model
    with sliding-window layers (``sliding``), else :data:`SDPA_FP32_DECODE` for a bf16 or fp16
    model (:func:`half_on_cpu`); ``"sdpa"`` otherwise."""
    if device.type == "cpu" and sliding:
        return SDPA_BANDED
    return SDPA_FP32_DECODE if half_on_cpu(device, dtype) else "sdpa"
