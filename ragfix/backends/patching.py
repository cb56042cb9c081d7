"""One reversible patch handle per attention module, shared by every method that replaces an
attention forward (channel scaling, GALI).

Two methods that both replace the same module's ``forward`` cannot be stacked correctly (each
computes attention from pre-RoPE states its own way), so the second one is refused with a one-line
:class:`~ragfix.errors.IncompatibleMethodsError` naming both; removing a patch restores exactly
the forward it replaced and never another method's. Methods that change weights (adapters) or
the rotary embedding (RoPE scaling) compose with these patches.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ragfix.errors import IncompatibleMethodsError

#: instance attribute holding the owner name of the patch applied to a module
OWNER_ATTR = "_ragfix_attention_patch"


class AttentionPatch:
    """Handle of one method's patch over a set of attention modules.

    Attributes:
        owner: the method's name (e.g. ``"channel-scaled"``).
        modules: the patched modules, in order.
    """

    def __init__(self, owner: str, modules: list):
        self.owner = owner
        self.modules = modules

    def remove(self) -> None:
        """Restore the forwards this patch replaced (idempotent)."""
        for m in self.modules:
            if m.__dict__.get(OWNER_ATTR) == self.owner:
                del m.forward
                delattr(m, OWNER_ATTR)
        self.modules = []

    def __enter__(self) -> AttentionPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def patch_attention(owner: str, modules: Sequence, forward: Callable) -> AttentionPatch:
    """Replace ``forward`` of each module by ``forward`` bound to it (``forward(module, ...)``).

    Args:
        owner: the method's name, shown in the refusal of a second patch.
        modules: attention modules (``nn.Module``).
        forward: the new forward; it receives the module as first argument.

    Returns:
        an :class:`AttentionPatch` (``remove()`` undoes it).

    Raises:
        IncompatibleMethodsError: a module already carries a patch (of any method).
    """
    for i, m in enumerate(modules):
        other = m.__dict__.get(OWNER_ATTR)
        if other is not None:
            raise IncompatibleMethodsError(
                f"{owner} cannot be combined with {other}: both replace the attention forward "
                f"(module {i} of {len(modules)} is already patched by {other})"
            )
    for m in modules:
        m.forward = types.MethodType(forward, m)
        setattr(m, OWNER_ATTR, owner)
    return AttentionPatch(owner, list(modules))


@contextmanager
def routed(owner: str, modules: Sequence, forward: Callable, run) -> Iterator[None]:
    """Route every module through ``forward(module, run, *args, **kwargs)`` while the block runs
    (one :func:`patch_attention` handle, removed on exit): how a method with per-call state
    (``run``: its cache, positions, tables) takes over the attention.

    Raises:
        IncompatibleMethodsError: a module already carries a patch.
    """

    def bound(attn, *args, **kwargs):
        return forward(attn, run, *args, **kwargs)

    with patch_attention(owner, modules, bound):
        yield


def attention_modules(model) -> list:
    """The self-attention modules of the decoder layers, in order."""
    return [layer.self_attn for layer in model.get_decoder().layers]


__all__ = [
    "AttentionPatch",
    "attention_modules",
    "patch_attention",
    "routed",
]
