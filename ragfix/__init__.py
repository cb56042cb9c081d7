"""ragfix: fix position bias in retrieval-augmented generation."""

_LAZY = {"RagFixPostprocessor": "ragfix.postprocessor", "RagFixLLM": "ragfix.llm"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    """Import the LlamaIndex integrations on first use (``import ragfix`` stays light)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragfix' has no attribute {name!r}")
