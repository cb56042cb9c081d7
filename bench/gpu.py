"""``ragfix bench gpu``: the one-command check of a CUDA machine (no network needed: the
repository, its installed packages and the embedded SmolLM2).

In order, each step writing its result file under ``out`` (default ``results/``):

1. ``gpu-mechanism.json``: the family mechanism tests (``tests/test_families.py``: vanilla equal
   to plain transformers on every path, every method's neutral setting, pine's and set-based's
   order invariance, the capability table's cells) run by pytest on the device
   (``RAGFIX_TEST_DEVICE``), fp32 and bf16, sdpa and eager: counts and the failing test ids.
2. ``gpu-kv8-test30-methods.json``: SmolLM2 on held-out KV-8 (records ``200:230``, the gold pair
   at every position), ``vanilla``, ``attention-sort`` and ``pine`` in the device's default dtype
   (bf16 on CUDA), compared as ``ragfix report --json`` compares (intervals, McNemar against
   vanilla); the run folders under ``runs``.

It refuses to start without the device (:class:`~ragfix.errors.ConfigError`), so a CPU run never
files CPU figures as GPU ones; ``device="cpu"`` runs the same steps on the CPU (how its own test
checks it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ragfix.models.device import parent_death_signal

#: the backends of the KV-8 sweep
GPU_BACKENDS = ("vanilla", "attention-sort", "pine")
#: the held-out KV-8 records (the README's held-out range)
GPU_RECORDS = "200:230"
#: the mechanism tests run on the device
MECHANISM_TESTS = ("tests/test_families.py",)
KV_FILE = "data/litm_kv_retrieval_140_keys.jsonl.gz"


def _junit_counts(xml: Path) -> dict:
    """Passed, failed, errors and skipped of a pytest JUnit XML file, with the failing ids."""
    from xml.etree import ElementTree

    failed, counts = [], {"passed": 0, "failed": 0, "skipped": 0}
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failed}


def mechanism_tests(
    device: str, root: Path, tests: Sequence[str] = MECHANISM_TESTS, select: str | None = None
) -> dict:
    """Run ``tests`` (paths under ``root``) with pytest in a subprocess on ``device``.

    Returns:
        ``{"device", "tests", "passed", "failed", "skipped", "failures": [ids], "exit": rc}``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        cmd += [*tests, *(["-k", select] if select else [])]
        env = {**os.environ, "RAGFIX_TEST_DEVICE": device}
        done = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, preexec_fn=parent_death_signal()
        )
        if not xml.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            from ragfix.errors import ConfigError

            raise ConfigError(f"the mechanism tests did not run: {tail[0]}")
        return {
            "device": device,
            "tests": list(tests),
            **_junit_counts(xml),
            "exit": done.returncode,
        }


def gpu_check(
    out: str | Path = "results",
    runs: str | Path = "runs/gpu",
    *,
    device: str = "cuda",
    records: str = GPU_RECORDS,
    backends: Sequence[str] = GPU_BACKENDS,
    select: str | None = None,
    root: str | Path = ".",
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """The steps of the module docstring.

    Returns:
        ``{"mechanism": the tests' counts, "comparison": the sweeps' comparison (as
        :func:`~ragfix.eval.compare.compare_runs` gives it), "path": its result file}``.

    Args:
        out: folder of the result files.
        runs: folder of the sweeps' run folders (resumable).
        device: ``cuda``, ``cuda:1``, ... (``cpu`` for the command's own test).
        records: the KV-8 record range.
        select: a pytest ``-k`` expression narrowing the mechanism tests.
        root: the repository (its ``tests/`` and ``data/``).

    Raises:
        ConfigError: ``device`` is CUDA and no CUDA device is visible, or the tests cannot run.
    """
    import torch

    from ragfix.errors import ConfigError
    from ragfix.eval.compare import compare_runs, write_comparison
    from ragfix.eval.sweep_run import run_sweep
    from ragfix.io import atomic_write_json

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"ragfix bench gpu: no CUDA device visible (asked for {device})")
    root, out, runs = Path(root), Path(out), Path(runs)
    out.mkdir(parents=True, exist_ok=True)
    progress("mechanism tests")
    mech = mechanism_tests(device, root, select=select)
    if device.startswith("cuda"):
        mech["gpu"] = torch.cuda.get_device_name(torch.device(device))
    atomic_write_json(out / "gpu-mechanism.json", mech)
    folders = []
    for name in backends:
        progress(f"KV-8 {records} · {name}")
        folder = runs / f"kv8-{name}"
        run_sweep(
            root / KV_FILE,
            folder,
            backend=name,
            num_docs=8,
            positions="all",
            records=records,
            device=device,
            workers=1,
        )
        folders.append(folder)
    comparison = compare_runs(folders, plot=runs / "kv8.png")
    path = out / "gpu-kv8-test30-methods.json"
    write_comparison(path, comparison)
    return {"mechanism": mech, "comparison": comparison, "path": str(path)}


__all__ = ["GPU_BACKENDS", "GPU_RECORDS", "gpu_check", "mechanism_tests"]
