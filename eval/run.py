"""The run folder: the one shape of every resumable run (the position sweep, the pipeline sweep,
the judge and perplexity).

A run folder holds ``config.json`` (a :class:`RunConfig`: what the user asked, the backend's
:meth:`~ragfix.backends.Backend.identity` and a content fingerprint of every input file), an
append-only JSON Lines store of finished cells keyed by a cell id, and the run's summary. Each run
kind supplies only its cells, how to compute them and how to summarise them.

The lifecycle, the same for every kind:

1. :meth:`RunFolder.check` with the request alone (``identity`` not yet known), before anything
   is loaded: a folder of another request is refused at once.
2. The backend is loaded (also when every cell is finished: a finished folder is checked too)
   and :meth:`RunFolder.bind` checks its identity and the inputs' content before any cell is
   reused. A mismatch raises :class:`~ragfix.errors.ConfigMismatchError` naming each changed
   field (``identity.model.weights``, ``inputs.data``); with ``restart`` the folder's files are
   removed instead and the run starts over. A folder written before run folders recorded what
   they ran on (no ``format``) is refused in one line.
3. :meth:`RunFolder.append` stores each finished cell, writing ``config.json`` just before the
   first one, so a run that fails before any result leaves nothing that blocks the corrected
   rerun.

Library code prints nothing here; progress and tables are the caller's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from ragfix.errors import ConfigMismatchError, DataError, Interrupted
from ragfix.io import CONFIG_FILE, JsonlStore, atomic_write_json, read_run_config

#: the version of the run folder layout; a ``config.json`` without it predates identity binding
RUN_FORMAT = 2


class RunConfig(BaseModel):
    """Base of every run kind's configuration (frozen, unknown fields refused).

    Attributes:
        run: the run kind (``sweep``, ``pipeline``, ``judge``, ``ppl``): each subclass fixes it
            with a ``Literal`` default.
        format: :data:`RUN_FORMAT`.
        identity: what the run ran on: the backend's ``identity()`` (weights fingerprint,
            adapter and calibration fingerprints, options, chat template), as JSON; for a run of
            several backends (perplexity), ``{label: identity}``. Empty until the backend is
            loaded (:meth:`RunFolder.bind`).
        inputs: ``{role: content fingerprint}`` of every input file or folder (``data``,
            ``distractor_pool``, ``corpus``, ``questions``).

    ``ABSENT`` (a class attribute, not a field) maps a field added after ``config.json`` files
    were already written to what such a file stands for without it (a run made before records
    kept their prompts: ``{"log_prompts": False}``), so :meth:`RunFolder.check` compares an old
    folder with what it really holds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    ABSENT: ClassVar[dict] = {}

    run: str
    format: int = RUN_FORMAT
    identity: dict = Field(default_factory=dict)
    inputs: dict[str, str] = Field(default_factory=dict)

    def stored(self) -> dict:
        """The configuration as written to ``config.json``."""
        return self.model_dump(mode="json")


def flat_differences(theirs: dict, mine: dict, prefix: str = "") -> list[str]:
    """``"key.sub: X there, Y now"`` for every leaf of ``mine`` whose value differs from
    ``theirs`` (nested dicts compared key by key, so a changed weight fingerprint reads
    ``identity.model.weights``); keys only in ``theirs`` count too."""
    out = []
    for k in [*mine, *(k for k in theirs if k not in mine)]:
        a, b, name = theirs.get(k), mine.get(k), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += flat_differences(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name}: {_short(a)} there, {_short(b)} now")
    return out


def _short(value, width: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= width else text[: width - 3] + "..."


def folder_store(out: Path, results: str, key: str, own: str | None = None) -> JsonlStore:
    """The store of a run folder: appends to ``own`` (default ``results``) and reads every file
    of the folder named like ``results`` (``results.jsonl`` and the rank shards
    ``results.rank{r}.jsonl``), so finished cells are skipped whoever computed them."""
    stem, _, suffix = results.rpartition(".")
    own_path = Path(out) / (own or results)
    others = sorted(p for p in Path(out).glob(f"{stem}*.{suffix}") if p != own_path)
    return JsonlStore(own_path, key=key, read_also=others)


def input_fingerprints(**paths: str | Path | None) -> dict[str, str]:
    """``{role: content fingerprint}`` of every given input file or folder (``None`` skipped),
    for :attr:`RunConfig.inputs`: an input edited in place gets a new fingerprint.

    Raises:
        DataError: an input that does not exist.
    """
    from ragfix.fingerprint import content_fingerprint

    out = {}
    for role, p in paths.items():
        if p is None:
            continue
        if not Path(p).exists():
            raise DataError(p, None, None, "file not found")
        out[role] = content_fingerprint(p)
    return out


class RunFolder:
    """A run folder on disk: its configuration, its store of finished cells and its files.

    Args:
        out: the folder (created on the first append).
        config: the run's configuration; ``identity`` may be empty until :meth:`bind`.
        results: the store's file name (``results.jsonl``, ``judgments.jsonl``, ...).
        key: the field of a record that identifies its cell.
        own: the file this process appends to (a rank's shard), default ``results``; every
            ``results``-like file of the folder is read.
        outputs: more files the run writes (summary, plot), removed by a restart.
    """

    def __init__(
        self,
        out: str | Path,
        config: RunConfig,
        *,
        results: str,
        key: str,
        own: str | None = None,
        outputs: tuple[str, ...] = (),
    ) -> None:
        self.out = Path(out)
        self.config = config
        self.results = results
        self.key = key
        self.outputs = outputs
        self.store = folder_store(self.out, results, key, own)
        self._has_config = False

    # ------------------------------------------------------------------ checks
    def check(self) -> bool:
        """Whether the folder holds a configuration, refusing one that differs from
        :attr:`config` (the identity is compared only once bound: a non-empty ``identity``).

        Raises:
            ConfigMismatchError: the folder holds another run kind, a configuration from before
                run folders recorded what they ran on, or other settings, weights or inputs
                (the message names every differing field).
            DataError: ``config.json`` is not readable JSON.
        """
        theirs = read_run_config(self.out)
        if theirs is None:
            return False
        if "format" not in theirs or "identity" not in theirs:
            raise ConfigMismatchError(
                f"{self.out} was written by an earlier ragfix whose {CONFIG_FILE} does not record "
                "the weights and inputs it ran on, so its cells cannot be checked: rerun with "
                "--restart to start it over, or use another --out folder"
            )
        theirs = {**self.config.ABSENT, **theirs}
        mine = self.config.stored()
        if not mine["identity"]:
            theirs = {**theirs, "identity": {}}
        detail = flat_differences(theirs, mine)
        if detail:
            raise ConfigMismatchError(
                f"{self.out} holds a run of other settings, weights or inputs "
                f"({'; '.join(detail)}): rerun with --restart to start it over, or use another "
                "--out folder"
            )
        self._has_config = True
        return True

    def bind(self, identity: dict, restart: bool = False) -> None:
        """Record the loaded backend's identity in the configuration and check the folder
        against it before any cell is reused; with ``restart``, remove the folder's files
        instead when it holds another configuration (or one from an earlier ragfix).

        Raises:
            ConfigMismatchError, DataError: see :meth:`check` (not with ``restart``).
        """
        ident = json.loads(json.dumps(identity))
        self.config = self.config.model_copy(update={"identity": ident})
        if not restart:
            self.check()
            return
        try:
            self.check()
        except (ConfigMismatchError, DataError):
            self.clear()

    def clear(self) -> None:
        """Remove the folder's configuration, stores and outputs (a restart)."""
        stem, _, suffix = self.results.rpartition(".")
        for p in [*self.out.glob(f"{stem}*.{suffix}"), self.out / CONFIG_FILE]:
            p.unlink(missing_ok=True)
        for name in self.outputs:
            (self.out / name).unlink(missing_ok=True)
        self._has_config = False

    # ------------------------------------------------------------------ cells
    def done(self) -> dict[str, dict]:
        """The finished cells of every store file of the folder, by cell id."""
        return self.store.load()

    def append(self, record: dict) -> None:
        """Store one finished cell; ``config.json`` is written just before the first one."""
        if not self._has_config:
            self.write_config()
        self.store.append(record)

    def write_config(self) -> None:
        """Write ``config.json`` (atomically)."""
        atomic_write_json(self.out / CONFIG_FILE, self.config.stored())
        self._has_config = True


def interrupted(stored: int, unit: str, out: str | Path) -> Interrupted:
    """What a run raises on Ctrl-C once its work in flight has stopped and every result that had
    arrived is stored: an :class:`~ragfix.errors.Interrupted` saying that ``stored`` results
    (``unit``: ``"cell"``, ``"pair"``) computed by this run are in ``out`` (the CLI prints it
    after ``interrupted:``, with how to resume)."""
    return Interrupted(f"{stored} {unit}(s) computed by this run are stored in {out}")


__all__ = [
    "RUN_FORMAT",
    "RunConfig",
    "RunFolder",
    "flat_differences",
    "folder_store",
    "input_fingerprints",
    "interrupted",
]
