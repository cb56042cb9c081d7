"""The backend registry: ``load_backend(name, model=..., adapter=..., **options)``.

A backend is registered under a name with its options model and a factory
(:func:`register_backend`); the built-in ones live in their own modules and are imported only
when asked for. Loading validates the options first (before any weights are read), loads the
model (:func:`ragfix.models.load.load_model`), applies an adapter if one is given
(:func:`ragfix.lora.load_adapter`: every backend takes one) and builds the backend.

``import ragfix.backends`` imports neither torch nor a method: the registry (names, summaries)
is read without them (the CLI's ``--help``), and the model interface's names (``Backend``,
``BackendOptions``, ``Fit``, ``Prompt``) are imported from :mod:`ragfix.backends.base` on first
use.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ragfix.errors import ConfigError

if TYPE_CHECKING:
    from ragfix.backends.base import Backend, BackendOptions
    from ragfix.backends.orders import OrderOptions

#: names re-exported from the model interface, imported on first use (see the module docstring)
_LAZY = {name: "ragfix.backends.base" for name in ("Backend", "BackendOptions", "Fit", "Prompt")}


def __getattr__(name: str):
    """The model interface's names, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragfix.backends' has no attribute {name!r}")


@dataclass(frozen=True)
class BackendSpec:
    """A registered backend.

    Attributes:
        name: the registry name.
        target: the backend class, or ``"module:Class"`` imported on first use. The class has
            ``options_model``, ``load_kwargs(options)`` and is built as
            ``cls(model, tokenizer, adapter=info, **options)``.
        requires_adapter: the backend is an adapter over the vanilla model (``pos2distill``).
        summary: one line for ``--help``.
    """

    name: str
    target: type | str
    requires_adapter: bool = False
    summary: str = ""

    def resolve(self) -> type:
        """The backend class."""
        if isinstance(self.target, str):
            module, cls = self.target.split(":")
            return getattr(importlib.import_module(module), cls)
        return self.target


_REGISTRY: dict[str, BackendSpec] = {}


def register_backend(
    name: str,
    target: type | str,
    *,
    requires_adapter: bool = False,
    summary: str = "",
) -> None:
    """Register a backend class under ``name`` (a later registration replaces an earlier one).

    Args:
        name: the registry name (``--backend NAME``).
        target: a :class:`~ragfix.backends.hf.HFBackend` subclass (its ``options_model`` holds
            the options, frozen once built) or its ``"module:Class"`` path.
        requires_adapter: refuse to load without ``adapter=``.
        summary: one line shown in ``--help``.
    """
    _REGISTRY[name] = BackendSpec(name, target, requires_adapter, summary)


register_backend("vanilla", "ragfix.backends.hf:HFBackend", summary="the model as it is")
register_backend(
    "channel-scaled",
    "ragfix.backends.channel_scaling:ChannelScalingBackend",
    summary="positional channel scaling (arXiv 2406.02536)",
)
register_backend(
    "gali", "ragfix.backends.gali:GaliBackend", summary="GALI past the window (arXiv 2502.02659)"
)
register_backend(
    "rope-scaled",
    "ragfix.backends.rope_scaled:RopeScaledBackend",
    summary="RoPE scaling baselines (linear, dynamic NTK, YaRN)",
)
register_backend(
    "truncated",
    "ragfix.backends.truncated:TruncatedBackend",
    summary="middle truncation to the window (baseline)",
)
register_backend(
    "set-based",
    "ragfix.backends.set_based:SetBasedBackend",
    summary="passages read as a set, order-invariant in one pass (arXiv 2406.06581)",
)
register_backend(
    "pine",
    "ragfix.backends.pine:PineBackend",
    summary="PINE: passages read order-invariantly, positions by importance (arXiv 2407.01100)",
)
register_backend(
    "attention-sort",
    "ragfix.backends.attention_sort:AttentionSortBackend",
    summary="passages sorted by (calibrated) query attention, most attended last (2410.02642)",
)
register_backend(
    "calibrated-attention",
    "ragfix.backends.calibrated_attention:CalibratedAttentionBackend",
    summary="Found in the Middle: passage attention minus its content-free bias (2406.16008)",
)
register_backend(
    "pos2distill",
    "ragfix.backends.hf:HFBackend",
    requires_adapter=True,
    summary="vanilla with a Pos2Distill adapter (arXiv 2508.15709); needs --adapter",
)


def backend_names() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(_REGISTRY)


def backend_spec(name: str) -> BackendSpec:
    """The spec registered under ``name``.

    Raises:
        ConfigError: unknown backend (the message lists the known ones).
    """
    if name not in _REGISTRY:
        raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(backend_names())}")
    return _REGISTRY[name]


def backend_class(name: str, model: str) -> type[Backend]:
    """The class :func:`load_backend` builds for backend ``name`` over ``model``, resolved
    without loading anything (a remote model, ``openai:NAME``, is always
    :class:`~ragfix.backends.remote.RemoteBackend`).

    Raises:
        ConfigError: unknown backend.
    """
    from ragfix.models.resolve import REMOTE_PREFIX

    spec = backend_spec(name)
    if model.startswith(REMOTE_PREFIX):
        from ragfix.backends.remote import RemoteBackend

        return RemoteBackend
    return spec.resolve()


def validate_backend(
    name: str, adapter: str | None = None, *, model: str | None = None, **options
) -> BackendOptions:
    """Check a backend name, its options and the adapter requirement without loading anything.

    Args:
        name, adapter, **options: as for :func:`load_backend`.
        model: the model name, when known: a remote model (``openai:NAME``) takes
            :class:`~ragfix.backends.remote.RemoteOptions` and no method or adapter.

    Returns:
        the validated, frozen options.

    Raises:
        ConfigError: unknown backend, an adapter backend without ``adapter``, or a method
            backend or adapter asked of a remote model.
        pydantic.ValidationError: an unknown or invalid option.
    """
    from ragfix.models.resolve import REMOTE_PREFIX

    spec = backend_spec(name)
    if model is not None and model.startswith(REMOTE_PREFIX):
        if name != "vanilla" or adapter:
            what = f"backend {name!r}" if name != "vanilla" else "an adapter"
            raise ConfigError(
                f"{what} changes the model's weights or attention, which a remote model "
                f"({model}) does not expose: serve the method with `ragfix serve --backend "
                f"{name}` and use --backend vanilla here"
            )
        from ragfix.backends.remote import RemoteOptions

        return RemoteOptions(**options)
    opts = spec.resolve().options_model(**options)
    if spec.requires_adapter and not adapter:
        raise ConfigError(f"backend {name!r} needs an adapter folder (--adapter PATH)")
    return opts


def load_backend(
    name: str = "vanilla",
    model: str = "smollm2",
    device: str = "auto",
    dtype: str = "auto",
    adapter: str | None = None,
    *,
    validated: BackendOptions | None = None,
    orders: OrderOptions | None = None,
    **options,
) -> Backend:
    """Load ``model`` with ``adapter`` applied and wrap it in backend ``name``; the options are
    validated here, once (the backend is built with the validated object). With ``orders`` the
    backend answers over several orders of each prompt's passages
    (:class:`~ragfix.backends.orders.OrderMarginalBackend`; any backend, a remote one too).

    Args:
        name: a registered backend (:func:`backend_names`).
        model: see :func:`ragfix.models.load.load_model`; ``openai:NAME`` is model ``NAME`` of an
            OpenAI-compatible server (:class:`~ragfix.backends.remote.RemoteBackend`: only
            ``vanilla``, no adapter; the options are
            :class:`~ragfix.backends.remote.RemoteOptions`, ``api_base`` first).
        device: ``"auto"`` (CUDA when present), ``"cpu"``, ``"cuda:1"`` ...
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU) or a dtype name.
        adapter: a ``ragfix distill`` or peft LoRA folder for this base model; any backend takes
            one (the LoRA is merged into the weights before the method patches the model).
        validated: the options as :func:`validate_backend` returned them for the same
            ``name``, ``adapter`` and ``model`` (a caller that checked them before loading);
            then no ``**options``.
        orders: order marginalization's settings, or ``None`` (one order, as given).
        **options: the backend's options.

    Raises:
        ConfigError: unknown backend, a missing adapter, or a method or adapter asked of a
            remote model.
        UnsupportedModelError: the method cannot run on the model's family (read from its
            config, before any weights are loaded).
        pydantic.ValidationError: invalid backend options (before any weights are loaded).
        RagfixError: a remote endpoint that cannot be reached.
        ModelNotFoundError: the model cannot be found.
        AdapterError: the adapter belongs to other weights or does not attach.
    """
    from ragfix.backends.family import read_family
    from ragfix.backends.orders import marginalize_orders
    from ragfix.models.load import load_model
    from ragfix.models.resolve import REMOTE_PREFIX, load_config

    if validated is None:
        opts = validate_backend(name, adapter, model=model, **options)
    elif options:
        raise TypeError("load_backend takes validated= or keyword options, not both")
    else:
        opts = validated
    cls = backend_class(name, model)
    if model.startswith(REMOTE_PREFIX):
        return marginalize_orders(cls(model[len(REMOTE_PREFIX) :], opts), orders)
    cls.check_family(read_family(load_config(model)), opts)
    m, tok = load_model(model, device=device, dtype=dtype, **cls.load_kwargs(opts))
    info = None
    if adapter:
        from ragfix.lora import load_adapter

        m, info = load_adapter(m, adapter)
    backend = cls(m, tok, adapter=info, options=opts)
    backend.name = name
    return marginalize_orders(backend, orders)


class BackendRef(BaseModel):
    """What :func:`load_backend` needs to load a backend, as data (for components that are
    saved to a file and loaded again, e.g. Haystack's YAML pipelines).

    Attributes:
        name: a registered backend.
        model: see :func:`ragfix.models.load.load_model`.
        adapter: a LoRA adapter folder, or ``None``.
        options: the backend's options.
        orders: order marginalization's settings
            (:class:`~ragfix.backends.orders.OrderOptions` as a dict), or ``None``: one order.
        device, dtype: where and how to load it.

    Raises:
        pydantic.ValidationError: an unknown field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "vanilla"
    model: str = "smollm2"
    adapter: str | None = None
    options: dict = Field(default_factory=dict)
    orders: dict | None = None
    device: str = "auto"
    dtype: str = "auto"

    @classmethod
    def of(cls, backend: Backend) -> BackendRef:
        """The reference of a loaded backend (its name, model, options and adapter path, from
        :meth:`Backend.identity`; an order-marginalized backend's orders and the backend it
        wraps; device and dtype ``auto``)."""
        from ragfix.backends.orders import OrderMarginalBackend

        orders = None
        if isinstance(backend, OrderMarginalBackend):
            orders, backend = backend.options.model_dump(mode="json"), backend.inner
        adapter = backend.identity().get("adapter") or {}
        return cls(
            name=backend.name,
            model=backend.model_name,
            adapter=adapter.get("path"),
            options=backend.options.model_dump(mode="json"),
            orders=orders,
        )

    #: the options as :func:`validate_backend` returned them, and the (name, adapter, model,
    #: options) they were validated for: a copy with other settings validates again
    _validated: tuple[str, BackendOptions] | None = PrivateAttr(default=None)

    def _settings_key(self) -> str:
        what = [self.name, self.adapter, self.model, self.options]
        return json.dumps(what, sort_keys=True, default=str)

    def check(self) -> BackendRef:
        """``self`` once the backend name, options and adapter requirement are valid (nothing is
        loaded). They are validated once per settings: the validated options are kept
        (:attr:`validated`), so checking again and loading do not validate them again; a copy
        with other settings validates again.

        Raises:
            ConfigError: unknown backend or a missing adapter.
            pydantic.ValidationError: an unknown or invalid backend option.
        """
        key = self._settings_key()
        if self._validated is None or self._validated[0] != key:
            opts = validate_backend(self.name, self.adapter, model=self.model, **self.options)
            self._validated = (key, opts)
        return self

    @property
    def validated(self) -> BackendOptions:
        """The backend's options, validated once per settings (:meth:`check`).

        Raises:
            see :meth:`check`.
        """
        return self.check()._validated[1]

    def load(self, shared: bool = True) -> Backend:
        """The backend: with ``shared``, loaded once per reference in this process (the
        components of one pipeline that name the same backend share its model); else a fresh
        one, freed when the caller drops it (a run's backend).

        Raises:
            see :func:`load_backend`.
        """
        if not shared:
            return self._load()
        key = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        if key not in _LOADED:
            _LOADED[key] = self._load()
        return _LOADED[key]

    def _load(self) -> Backend:
        from ragfix.backends.orders import OrderOptions

        orders = None if self.orders is None else OrderOptions(**self.orders)
        return load_backend(
            self.name, self.model, self.device, self.dtype, self.adapter, orders=orders,
            validated=self.validated,
        )  # fmt: skip


_LOADED: dict[str, Backend] = {}


def result_options(options: dict, validated: BackendOptions) -> dict:
    """The backend options that decide answers (for run configurations and cell ids): ``options``
    without the ``validated`` options' :attr:`~BackendOptions.call_settings` (a remote model's
    concurrency, retries and timeout), so a rerun with other call settings resumes the run."""
    return {k: v for k, v in options.items() if k not in validated.call_settings}


__all__ = [
    "Backend",
    "BackendOptions",
    "BackendRef",
    "BackendSpec",
    "Fit",
    "Prompt",
    "backend_class",
    "backend_names",
    "backend_spec",
    "load_backend",
    "register_backend",
    "result_options",
    "validate_backend",
]
