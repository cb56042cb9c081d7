"""The error family for mistakes a user can fix (bottom layer: imports nothing of ragfix).

Every error that names a user's mistake (a bad file, a bad setting, a missing model, a run folder
holding another configuration) derives from :class:`RagfixError`. The CLI prints exactly these as
one line with exit code 2; any other exception is a bug and keeps its traceback.

``RagfixError`` derives from ``ValueError`` so that code catching ``ValueError`` around a bad
input keeps working. :class:`Interrupted` is Ctrl-C once the work in flight has stopped, carrying
what was kept.
"""

from __future__ import annotations


class RagfixError(ValueError):
    """A mistake the user can fix; its message names the file, line, field or setting."""


class DataError(RagfixError):
    """A bad input record or file. ``str()`` is one line: ``path:line: field: message``.

    Attributes:
        path, line, field, message: where the fault is and what it is (``line`` / ``field``
            may be ``None`` for a fault of the whole file).
    """

    def __init__(self, path, line: int | None, field: str | None, message: str):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {field + ': ' if field else ''}{message}")

    def __reduce__(self):
        """Pickle by the four fields (a sweep's worker process raises it to the parent)."""
        return type(self), (self.path, self.line, self.field, self.message)


class ConfigError(RagfixError):
    """A setting that cannot work (unknown, out of range, or incompatible with the model)."""


class ConfigMismatchError(ConfigError):
    """A run folder holds results of a different configuration."""


class ModelNotFoundError(RagfixError):
    """A model name that is neither embedded, cached, a local folder / GGUF file, nor a hub id."""


class ModelLoadError(RagfixError):
    """A model file that exists but cannot be loaded (not a complete GGUF file, an unsupported
    architecture); the message names the file and the reason."""


class AdapterError(RagfixError):
    """An adapter that does not belong to the model, or whose tensors do not attach to it."""


class MissingExtraError(RagfixError):
    """An optional integration whose framework is not installed; the message names the extra to
    install (``pip install "ragfix[langchain]"``)."""


class WorkerError(RagfixError):
    """A worker process of a run died or failed; the message says what happened and where its
    traceback is, and that the finished results are saved."""


class Cancelled(Exception):
    """A generation stopped because its caller set the cancel signal it passed
    (:class:`~ragfix.backends.base.Cancel`): no mistake of the user's, and nothing to report (the
    caller that asked for the stop is the one that sees it)."""


class IncompatibleMethodsError(RagfixError):
    """Two methods that cannot be combined on the same model (e.g. two attention patches)."""


class UnsupportedModelError(ConfigError):
    """A backend that cannot run on a model's family (``"gali does not support Gemma 3
    (gemma3_text): ..."``), raised from the model's config before any weights are loaded."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, raised once the work in flight has stopped (a ``KeyboardInterrupt``: code that
    knows only that still sees one).

    Args:
        message: what was kept (a run: how many results it stored); ``str()`` of the exception.
        done: the results that had arrived, by the index of their request (a backend's
            ``generate``: ``{prompt index: Generation}``; ``PairwiseJudge.judge_pairs``:
            ``{pair index: PairJudgment}``), for the caller to keep.
    """

    def __init__(self, message: str = "", done: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.done = dict(done or {})


__all__ = [
    "AdapterError",
    "Cancelled",
    "ConfigError",
    "ConfigMismatchError",
    "DataError",
    "IncompatibleMethodsError",
    "Interrupted",
    "MissingExtraError",
    "ModelLoadError",
    "ModelNotFoundError",
    "RagfixError",
    "UnsupportedModelError",
    "WorkerError",
]
