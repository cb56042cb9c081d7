"""Evaluation as a Python API: the position sweep (:func:`run_sweep`) and the pairwise judge
run (:func:`run_judge`), resumable and sharded exactly as ``ragfix eval`` and ``ragfix judge``;
:func:`merge_runs` joins the job shards of a run (``shard="i/N"``), as ``ragfix merge``.

Both names are imported on first use (PEP 562), so importing one module of the package (the run
folder of :mod:`ragfix.eval.run`, say) does not import the model code and torch."""

from ragfix.lazy import lazy_exports

_LAZY = {
    "merge_runs": "ragfix.eval.merge",
    "run_judge": "ragfix.eval.judge_run",
    "run_sweep": "ragfix.eval.sweep_run",
}
__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
