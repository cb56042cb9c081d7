"""Evaluation as a Python API: the position sweep (:func:`run_sweep`) and the pairwise judge
run (:func:`run_judge`), resumable and sharded exactly as ``ragfix eval`` and ``ragfix judge``.

Both names are imported on first use (PEP 562), so importing one module of the package (the run
folder of :mod:`ragfix.eval.run`, say) does not import the model code and torch."""

_LAZY = {"run_judge": "ragfix.eval.judge_run", "run_sweep": "ragfix.eval.sweep_run"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    """Import :func:`run_sweep` / :func:`run_judge` on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragfix.eval' has no attribute {name!r}")


def __dir__() -> list[str]:
    """Module attributes including the lazily imported names."""
    return sorted([*globals(), *_LAZY])
