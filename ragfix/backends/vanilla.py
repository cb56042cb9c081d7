"""The ``vanilla`` backend: the model as it is."""

from ragfix.backends.base import Backend


class VanillaBackend(Backend):
    """The unmodified model; the reference every other backend is measured against."""

    name = "vanilla"
