"""Backend registry: ``load_backend(name, model=..., **options)``.

Each backend lives in its own module and is imported only when asked for.
"""

from __future__ import annotations

import importlib

from ragfix.backends.base import Backend, BackendOptions, PrefixReuser

#: registry name -> "module:Class"
BACKENDS: dict[str, str] = {
    "vanilla": "ragfix.backends.vanilla:VanillaBackend",
    "channel-scaled": "ragfix.backends.channel_scaling:ChannelScalingBackend",
    "gali": "ragfix.backends.gali:GaliBackend",
    "rope-scaled": "ragfix.backends.rope_scaled:RopeScaledBackend",
    "truncated": "ragfix.backends.truncated:TruncatedBackend",
    "pos2distill": "ragfix.backends.pos2distill:Pos2DistillBackend",
}


def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``.

    Raises:
        ValueError: unknown backend (the message lists the known ones).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of: {', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_backend(
    name: str = "vanilla",
    model: str = "smollm2",
    device: str = "auto",
    dtype: str = "auto",
    **options,
) -> Backend:
    """Load ``model`` (see :func:`ragfix.models.load_model`) and wrap it in backend ``name``.

    Raises:
        ValueError: unknown backend.
        pydantic.ValidationError: invalid backend options.
        ragfix.models.ModelNotFoundError: the model cannot be found.
    """
    from ragfix.models import load_model

    cls = backend_class(name)
    cls.options_model(**options)  # fail on bad options before loading the model
    m, tok = load_model(model, device=device, dtype=dtype, **cls.load_kwargs(options))
    return cls(m, tok, **options)


__all__ = ["BACKENDS", "Backend", "BackendOptions", "PrefixReuser", "backend_class", "load_backend"]
