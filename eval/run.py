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

A run kind (:class:`RunKind`) supplies its configuration, its cells, how to compute a batch of
them and how to summarise the records; :func:`run` owns that lifecycle for every kind, with one
"resuming:" line, one progress bar and one Ctrl-C rule (:func:`interrupted`). It takes a loaded
backend or a :class:`~ragfix.backends.BackendRef` (as lm-eval's ``simple_evaluate`` takes an
``LM`` or a model name); every run configuration carries the reference it loads
(:attr:`RunConfig.backend_ref`).

Library code prints nothing here but the ``console`` a caller hands :func:`run`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from ragfix.backends import BackendRef
from ragfix.connectors.jsonl import SkipCounter
from ragfix.errors import ConfigError, ConfigMismatchError, DataError, Interrupted
from ragfix.eval.progress import RunTally, progress_bar
from ragfix.eval.shard import Shard, assign_groups, shard_manifests, write_manifest
from ragfix.io import CONFIG_FILE, JsonlStore, atomic_write_json, read_run_config

if TYPE_CHECKING:
    from ragfix.backends import Backend

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
            several backends (perplexity, one per method), what they share (the weights, chat
            template and tokenizer of the first). Empty until the backend is loaded
            (:meth:`RunFolder.bind`).
        inputs: ``{role: content fingerprint}`` of every input file or folder (``data``,
            ``distractor_pool``, ``corpus``, ``questions``).
        backend_ref: the backend the run loads (:class:`~ragfix.backends.BackendRef`: model,
            backend, options as given, adapter path as loaded, orders, device, dtype), or
            ``None`` for a configuration built only to name cells. Not written to
            ``config.json`` nor hashed into cell ids: each kind records the settings that
            decide its answers in its own fields (``model``, ``backend``, ``backend_options``
            without a remote model's call settings), as folders always have.

    A field that says where an input lies (:data:`INPUT_LOCATIONS`) is compared by the
    content's fingerprint in ``inputs``, not by the path (:func:`moved_inputs`).

    ``ABSENT`` (a class attribute, not a field) maps a field added after ``config.json`` files
    were already written to what such a file stands for without it (a run made before records
    kept their prompts: ``{"log_prompts": False}``), so :meth:`RunFolder.check` compares an old
    folder with what it really holds (through :meth:`absent`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    ABSENT: ClassVar[dict] = {}

    run: str
    format: int = RUN_FORMAT
    identity: dict = Field(default_factory=dict)
    inputs: dict[str, str] = Field(default_factory=dict)
    backend_ref: BackendRef | None = Field(default=None, exclude=True)

    def absent(self, stored: dict) -> dict:
        """What the fields missing from a stored ``config.json`` stand for (:attr:`ABSENT`; a
        kind overrides this where that depends on the stored configuration)."""
        return self.ABSENT

    def stored(self) -> dict:
        """The configuration as written to ``config.json``."""
        return self.model_dump(mode="json")


#: per run kind, the configuration fields that say where an input lies, each with its role in
#: ``inputs``. Only fields kept out of the cell ids belong here: the pipeline sweep's corpus and
#: question paths and perplexity's text file path are hashed into their cell ids, so those
#: folders stay bound to their paths.
INPUT_LOCATIONS: dict[str, dict[str, str]] = {
    "sweep": {"data": "data", "distractor_pool": "distractor_pool"},
    "judge": {"data": "data"},
}


def moved_inputs(theirs: dict, mine: dict) -> list[str]:
    """The fields of :data:`INPUT_LOCATIONS` whose path differs between two stored
    configurations of one run kind while both fingerprinted that input with the same content:
    the same input read from another place (a copied checkout, a moved file), which a rerun
    or a merge of shards accepts."""
    a, b = theirs.get("inputs") or {}, mine.get("inputs") or {}
    return [
        field
        for field, role in INPUT_LOCATIONS.get(mine.get("run"), {}).items()
        if theirs.get(field) != mine.get(field)
        and a.get(role) is not None
        and a.get(role) == b.get(role)
    ]


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
        self.own = own or results
        self.store = folder_store(self.out, results, key, own)
        self._has_config = False

    def write_shard(self, shard: Shard) -> None:
        """Append to job ``shard``'s own result file from now on (:meth:`Shard.own_file`)."""
        self.own = shard.own_file(self.own)
        self.store = folder_store(self.out, self.results, self.key, self.own)

    # ------------------------------------------------------------------ checks
    def check(self) -> bool:
        """Whether the folder holds a configuration, refusing one that differs from
        :attr:`config` (the identity is compared only once bound: a non-empty ``identity``).

        An input read from another place with the same content (:func:`moved_inputs`) is no
        difference; :meth:`bind` then records where it lies now.

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
        theirs = {**self.config.absent(theirs), **theirs}
        mine = self.config.stored()
        if not mine["identity"]:
            theirs = {**theirs, "identity": {}}
        theirs = {**theirs, **{k: mine[k] for k in moved_inputs(theirs, mine)}}
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
        try:
            self.check()
        except (ConfigMismatchError, DataError):
            if not restart:
                raise
            self.clear()
            return
        if moved_inputs(read_run_config(self.out) or {}, self.config.stored()):
            self.write_config()

    def clear(self) -> None:
        """Remove the folder's configuration, stores, job shard manifests and outputs (a
        restart)."""
        stem, _, suffix = self.results.rpartition(".")
        manifests = shard_manifests(self.out)
        for p in [*self.out.glob(f"{stem}*.{suffix}"), *manifests, self.out / CONFIG_FILE]:
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


class Tally(Protocol):
    """The running figure a progress bar shows (:class:`~ragfix.eval.progress.RunTally`)."""

    def add(self, record: dict) -> str: ...

    def status(self) -> str: ...


class Store:
    """What :meth:`RunKind.compute` hands each finished cell to: calling it stores the record in
    the run folder (when there is one); :meth:`arrived` counts a record another process stored
    (a worker of the sweep). Both advance the progress bar and the count :func:`interrupted`
    reports."""

    def __init__(self, folder: RunFolder | None, on_record: Callable[[dict], None]) -> None:
        self.folder = folder
        self.on_record = on_record
        self.records: list[dict] = []

    def __call__(self, record: dict) -> None:
        if self.folder is not None:
            self.folder.append(record)
        self.arrived(record)

    def arrived(self, record: dict) -> None:
        self.records.append(record)
        self.on_record(record)


class RunKind(ABC):
    """One kind of resumable run (the sweep, the pipeline sweep, the judge, perplexity): what
    :func:`run` needs besides the lifecycle it owns.

    Attributes:
        config: the request (:class:`RunConfig`, with its ``backend_ref``); :func:`run` binds the
            backend's identity into the folder's copy.
        backend: the loaded backend, set by :meth:`setup`; a kind may drop it once it no longer
            needs it (the sweep's worker processes load their own).
        key: the record field holding its cell id.
        unit: what one result is called (``"cell"``, ``"pair"``, ``"window"``).
        finished: how a stored result is described in the "resuming:" line (``"done"``,
            ``"judged"``).
        label: the progress bar's description.
        main: whether this process prints and shows the bar (False on a launcher's ranks but
            0).
        skipped: the inputs skipped with ``skip_invalid`` (by the time :meth:`setup` returns);
            :func:`run` notes them in one line (``skipped 2 invalid record(s); first: ...``).
        skips: what a skipped input is called in that line.
        console: where the kind's own notes go (set by :func:`run`; ``None``: quiet).
        shard: the job shard it computes part of (set by :func:`run`; ``None``: all of it).
    """

    config: RunConfig
    backend: Any = None
    key: ClassVar[str] = "cell_id"
    unit: ClassVar[str] = "cell"
    finished: ClassVar[str] = "done"
    label: str = "run"
    main: bool = True
    skipped: SkipCounter | None = None
    skips: ClassVar[str] = "invalid record"
    console: Console | None = None
    shard: Shard | None = None

    @abstractmethod
    def folder(self, out: Path) -> RunFolder:
        """The run folder of this kind in ``out``."""

    def setup(self, backend) -> None:
        """Take the loaded backend, before the folder is bound (checks that need it go here)."""
        self.backend = backend

    def bind(self, folder: RunFolder, restart: bool) -> None:
        """Bind ``folder`` to the backend's identity (:meth:`RunFolder.bind`)."""
        folder.bind(self.backend.identity(), restart=restart)

    @abstractmethod
    def cells(self) -> list[tuple[str, Any]]:
        """``(cell id, payload)`` of every cell of the run, in a stable order."""

    def split(self, cells: list[tuple[str, Any]], index: int, count: int) -> list[tuple[str, Any]]:
        """Part ``index`` of ``cells`` split ``count`` ways: disjoint parts that together hold
        every cell, the same for every process given the same cells. Here one cell at a time,
        balanced by number (:func:`~ragfix.eval.shard.assign_groups`); a kind whose cells share
        work overrides it (the sweep: whole samples, by prompt length). It splits a run among
        job shards (``--shard``, from all its cells) and among a launcher's ranks
        (:meth:`share`, from the cells left to do)."""
        keys = [cid for cid, _ in cells]
        return assign_groups(cells, [1.0] * len(cells), keys, count)[index]

    def share(self, todo: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The cells of ``todo`` this process computes (all of them but under a launcher)."""
        return todo

    def batch_size(self, on_gpu: bool) -> int:
        """The kind's batch size when neither the caller nor the backend names one."""
        return 1

    @abstractmethod
    def compute(self, todo: list[Any], store: Store, batch_size: int) -> None:
        """Compute the payloads ``todo`` on :attr:`backend`, calling ``store(record)`` as each
        finishes."""

    def tally(self, finished: list[dict]) -> Tally:
        """The progress bar's running figure, counting the records stored before."""
        return RunTally(finished)

    @abstractmethod
    def summarize(self, folder: RunFolder | None, records: list[dict]) -> Any:
        """The run's result from its records (in cell order; every stored one of this run's
        cells), writing its summary files."""


#: the run functions' defaults of the settings a reference or a loaded backend brings itself
#: (any other such setting: ``None``)
_UNSET = {"model": "smollm2", "device": "auto", "dtype": "auto"}


def backend_reference(
    backend: str | Backend | BackendRef, **settings: object
) -> tuple[BackendRef, Backend | None]:
    """The checked reference of the backend a run function computes with, and the backend itself
    when it was handed a loaded one (as lm-eval's ``simple_evaluate`` takes a loaded model).

    ``backend`` is one of:

    - a registered backend's name, with the call's ``settings`` (``model``, ``adapter``,
      ``backend_options``, ``orders``, ``device``, ``dtype``): the reference they make;
    - a :class:`~ragfix.backends.BackendRef` (the CLI's backend options build one): it,
      validated once (its options already validated are not validated again);
    - a loaded backend: its reference (:meth:`BackendRef.of <ragfix.backends.BackendRef.of>`:
      its name, model, options, adapter and orders).

    A reference and a loaded backend bring their own settings, so none of ``settings`` may then
    differ from the run function's default.

    Raises:
        ConfigError: a setting given beside a reference or a loaded backend (every one named);
            an unknown backend, a missing adapter.
        pydantic.ValidationError: an unknown or invalid backend option or order setting.
    """
    if isinstance(backend, str):
        adapter = settings.get("adapter")
        ref = BackendRef(
            name=backend,
            model=settings.get("model") or _UNSET["model"],
            adapter=str(adapter) if adapter else None,
            options=dict(settings.get("backend_options") or {}),
            orders=settings.get("orders"),
            device=settings.get("device") or _UNSET["device"],
            dtype=settings.get("dtype") or _UNSET["dtype"],
        )
        return ref.check(), None
    named = [k for k, v in settings.items() if v != _UNSET.get(k) and v]
    if named:
        named_list = ", ".join(named)
        what = "a backend reference" if isinstance(backend, BackendRef) else "a loaded backend"
        raise ConfigError(f"{what} brings its own settings: {named_list} not with it")
    if isinstance(backend, BackendRef):
        return backend.check(), None
    return BackendRef.of(backend).check(), backend


def default_batch_size(backend, device: str, kind: RunKind) -> int:
    """Cells per batch when the caller names none: the backend's preferred size (a remote
    model's concurrency); 1 for a model in bf16 or fp16 on the CPU; else the kind's default for
    the device (:meth:`RunKind.batch_size`). The device is where the backend's weights are
    (:attr:`~ragfix.backends.base.Backend.device`), ``device`` (``"auto"`` ...) only for a
    backend that holds none.

    On the CPU, a half-precision model's batched decoding steps round each row otherwise than
    the same prompt computed alone, and greedy answers change with the batch
    (``results/bench-sweep-squad10-dtypes.json``, SmolLM2 in bf16: the cells of a sample
    prefilled along their shared prefix and decoded in one batch kept the answer computed
    alone in 6 of 10 cells, prefix reuse at batch 1 in 10 of 10; float32 in 10 of 10 both
    ways). At batch 1 a cell's answer does not depend on the cells beside it, so two runs paired
    cell by cell differ by their method, not by how their cells were batched. A ``batch_size``
    named by the caller is kept.
    """
    if backend.preferred_batch_size:
        return backend.preferred_batch_size
    from ragfix.models import resolve_device
    from ragfix.models.device import half_on_cpu

    dev = backend.device if backend.device is not None else resolve_device(device)
    if half_on_cpu(dev, backend.dtype):
        return 1
    return kind.batch_size(dev.type == "cuda")


def run(
    kind: RunKind,
    backend,
    out: str | Path | None,
    *,
    restart: bool = False,
    batch_size: int | None = None,
    device: str | None = None,
    shard: Shard | None = None,
    console: Console | None = None,
) -> Any:
    """Run ``kind`` into the run folder ``out``, resumably: the lifecycle of every run kind.

    1. ``out`` is checked against the request before anything is loaded (not with ``restart``);
    2. ``backend`` is loaded when it is a :class:`~ragfix.backends.BackendRef` (also when every
       cell is stored: a finished folder is checked too) and handed to the kind
       (:meth:`RunKind.setup`); the inputs it skipped are noted in one line;
    3. the folder is bound to its identity (:meth:`RunKind.bind`); stored cells are reused, and
       a resumed run says so in one line (``resuming: 3 of 8 cells already done``);
    4. the other cells are computed (:meth:`RunKind.compute`), each stored as it arrives, under
       a progress bar with the kind's running figure;
    5. ``config.json`` is written if cells are stored without it (computed by other
       processes), and the records of the run's cells are summarised
       (:meth:`RunKind.summarize`).

    A job shard (``shard``) computes only its part of the cells (:meth:`RunKind.split` of all
    of them), appends to its own result file (:meth:`Shard.own_file`), writes its manifest
    (:func:`~ragfix.eval.shard.write_manifest`) and no summary: a summary of part of a run
    would read as the whole run's figure. :func:`~ragfix.eval.merge.merge_runs` joins the
    shards.

    Args:
        kind: the run kind.
        backend: a loaded backend or a reference to load.
        out: the run folder; ``None``: nothing is stored (every cell computed).
        restart: start ``out`` over when it holds another run, instead of refusing it.
        batch_size: cells per batch (default :func:`default_batch_size`).
        device: the device the backend is on, for the default batch size (default: the
            reference's, else ``"auto"``).
        shard: compute this job shard's part only (``None``: the whole run).
        console: where the "resuming:" line, the bar and the kind's notes go (``None``: quiet).

    Returns:
        what :meth:`RunKind.summarize` returns; a :class:`ShardDone` for a job shard.

    Raises:
        ConfigMismatchError: ``out`` holds another run (not with ``restart``).
        ConfigError: a ``shard`` without a run folder, or with ``restart``.
        Interrupted: Ctrl-C, once every record that had arrived is stored; its message says how
            many this run stored and where.
        the kind's and the backend's errors.
    """
    kind.console = console if kind.main else None
    kind.shard = shard
    if shard is not None and out is None:
        raise ConfigError("a job shard (--shard) needs a run folder to store its cells in")
    if shard is not None and restart:  # in a shared folder it would remove the other jobs' cells
        raise ConfigError(
            "--restart with --shard: start the run over once (remove its folders, or --restart "
            "without --shard), then launch the shards"
        )
    folder = None if out is None else kind.folder(Path(out))
    if folder is not None and shard is not None:
        folder.write_shard(shard)
    if folder is not None and not restart:
        folder.check()  # another request: refused before the backend is loaded
    if isinstance(backend, BackendRef):
        device = device or backend.device
        kind.setup(backend.load(shared=False))
    else:
        kind.setup(backend)
    del backend  # the kind holds it and may drop it
    if kind.skipped is not None and kind.skipped.count and kind.console is not None:
        kind.console.print(
            f"[yellow]skipped {kind.skipped.count} {kind.skips}(s)[/yellow]; first: "
            f"{kind.skipped.examples[0]}",
            highlight=False,
        )
    if folder is not None:
        kind.bind(folder, restart)
    done = folder.done() if folder is not None else {}
    cells = kind.cells()
    if shard is not None:
        part = {cid for cid, _ in kind.split(cells, shard.index, shard.count)}
        everything, cells = cells, [(cid, c) for cid, c in cells if cid in part]  # in run order
        if kind.main:
            write_manifest(
                folder.out,
                shard,
                results=folder.results,
                key=kind.key,
                cells=[cid for cid, _ in everything],
                mine=[cid for cid, _ in cells],
            )
    todo = [(cid, c) for cid, c in cells if cid not in done]
    if len(todo) < len(cells) and kind.main and console is not None:
        console.print(
            f"resuming: {len(cells) - len(todo)} of {len(cells)} {kind.unit}s already "
            f"{kind.finished}"
        )
    todo = kind.share(todo)
    if todo:
        size = batch_size or default_batch_size(kind.backend, device or "auto", kind)
        finished = [done[cid] for cid, _ in cells if cid in done]
        tally = kind.tally(finished)
        store = None
        try:
            with progress_bar(console, disable=console is None or not kind.main) as bar:
                task = bar.add_task(
                    kind.label,
                    total=len(todo) + len(finished),
                    completed=len(finished),
                    status=tally.status(),
                )
                store = Store(
                    folder, lambda rec: bar.update(task, advance=1, status=tally.add(rec))
                )
                kind.compute([c for _, c in todo], store, size)
        except KeyboardInterrupt:
            raise interrupted(len(store.records) if store else 0, kind.unit, out) from None
        if folder is None:
            done = {rec[kind.key]: rec for rec in store.records}
    if folder is not None:
        done = folder.done()
        if done and not folder.check():
            folder.write_config()
    if shard is not None:
        return ShardDone(
            shard=shard,
            out=Path(out),
            cells=len(cells),
            stored=sum(cid in done for cid, _ in cells),
            run_cells=len(everything),
        )
    return kind.summarize(folder, [done[cid] for cid, _ in cells if cid in done])


@dataclass(frozen=True)
class ShardDone:
    """What a job shard's run returns instead of a summary.

    Attributes:
        shard: the job.
        out: its run folder.
        cells: the cells of its part; ``stored``: how many of them its folder holds.
        run_cells: the whole run's cells.
    """

    shard: Shard
    out: Path
    cells: int
    stored: int
    run_cells: int

    def line(self) -> str:
        """One line for the terminal: what is stored and what comes next."""
        return (
            f"shard {self.shard.index}/{self.shard.count}: {self.stored} of its {self.cells} "
            f"cells (of the run's {self.run_cells}) are in {self.out}; once every shard is done, "
            "ragfix merge OUT SHARD_FOLDERS... and the same command without --shard over OUT "
            "write the run's summary"
        )


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
    "RunKind",
    "ShardDone",
    "Store",
    "default_batch_size",
    "run",
    "flat_differences",
    "moved_inputs",
    "folder_store",
    "input_fingerprints",
    "interrupted",
]
