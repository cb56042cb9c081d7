"""Evaluation as a Python API: the position sweep (:func:`run_sweep`) and the pairwise judge
run (:func:`run_judge`), resumable and sharded exactly as ``ragfix eval`` and ``ragfix judge``."""

from ragfix.eval.judge_run import run_judge
from ragfix.eval.sweep_run import run_sweep

__all__ = ["run_judge", "run_sweep"]
