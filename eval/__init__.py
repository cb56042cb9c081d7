"""Evaluation as a Python API: the position sweep (:func:`run_sweep`) and the pairwise judge
run (:func:`run_judge`), resumable and sharded exactly as ``ragfix eval`` and ``ragfix judge``."""

from ragfix.eval.api import run_sweep
from ragfix.eval.judge_run import run_judge

__all__ = ["run_judge", "run_sweep"]
