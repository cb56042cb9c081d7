"""``run_sweep``: the raw-model position sweep as a Python call (what ``ragfix eval DATA`` runs).

Resumable and sharded exactly as the command: the run folder's ``results*.jsonl`` hold one
record per finished cell, a rerun skips them, and under ``torchrun`` / ``accelerate launch`` each
rank computes its share of whole samples (:mod:`ragfix.eval.shard`) and rank 0 merges and
reports. The folder is a :class:`~ragfix.eval.run.RunFolder`: bound to the backend's identity
and the content of the data file and distractor pool, checked before any cell is reused
(finished folders included); ``config.json`` is written when the first cell is stored, so a run
that fails before any result (a bad option, a missing model) leaves nothing that blocks the
corrected rerun.

Cells whose prompt does not fit the model's window are flagged ``overflow``, never run, and their
samples left out of the accuracy at every position (:func:`ragfix.eval.sweep.summary_counts`):
the summary's ``flags`` count them per position, as they count a remote model's ``empty_answer``
and ``prompt_cut`` cells, left out the same way.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from ragfix.backends import Backend, BackendRef
from ragfix.connectors.jsonl import SkipCounter
from ragfix.connectors.records import parse_records
from ragfix.errors import ConfigError, DataError, RagfixError, WorkerError
from ragfix.eval.run import (
    RunFolder,
    RunKind,
    Store,
    backend_reference,
    input_fingerprints,
    run,
)
from ragfix.eval.shard import (
    Shard,
    assign_groups,
    distributed_state,
    merge_shards,
    sweep_workers,
    threads_per_worker,
)
from ragfix.eval.sweep import (
    Cell,
    SweepConfig,
    open_store,
    parse_positions,
    plan_cells,
    run_cells,
    summary_counts,
    sweep_folder,
)
from ragfix.eval.sweep_summary import write_report
from ragfix.io import atomic_write_text
from ragfix.tasks import get_task, resolve_task
from ragfix.types import SweepRecord

#: where a failed worker's traceback is written, in the run folder
WORKER_LOG = "worker-error.log"


def _resolve_data(data: str | Path) -> Path:
    """A bundled sample name (``nq-sample``, ``kv-sample``) or a path that exists.

    Raises:
        DataError: the file does not exist.
    """
    from ragfix.bundled import bundled_path

    path = bundled_path(str(data)) or Path(data)
    if not path.exists():
        raise DataError(path, None, None, "file not found")
    return path


def _my_share(todo: list[Cell], rank: int, world: int) -> list[Cell]:
    """Rank ``rank``'s cells: whole samples, balanced by prompt length (every rank computes the
    same split)."""
    if world == 1:
        return todo
    groups: dict[str, list[Cell]] = {}
    for c in todo:
        groups.setdefault(c.sample.id, []).append(c)
    keys = sorted(groups)
    weights = [
        len(groups[k]) * sum(len(p.text) + len(p.title) for p in groups[k][0].sample.distractors)
        for k in keys
    ]
    mine = assign_groups([groups[k] for k in keys], weights, keys, world)[rank]
    return [c for g in mine for c in g]


def _check_budget(backend, config: SweepConfig) -> None:
    """Raises ConfigError: the task's answer budget alone fills the backend's window (no prompt
    could fit; both numbers named)."""
    budget = get_task(config.task).max_new_tokens
    if budget >= backend.context_window and not backend.cuts_long_prompts:
        raise ConfigError(
            f"the {config.task} task's answer budget of {budget} tokens leaves no room for a "
            f"prompt in the {backend.context_window}-token window of {config.model}"
        )


def _compute(
    todo: list[Cell],
    backend,
    store: Callable[[SweepRecord], None],
    *,
    rank: int,
    world: int,
    log_prompts: bool,
    prefix_reuse: bool,
    batch_size: int,
) -> None:
    """Compute ``todo`` on ``backend`` in batches of ``batch_size`` and hand each record to
    ``store`` as it is done: without its prompt when the run keeps none
    (:attr:`SweepConfig.log_prompts`), with its rank in ``extra`` in a multi-process run."""

    def prepared(rec: SweepRecord) -> None:
        if not log_prompts:
            rec = rec.model_copy(update={"prompt": None})
        if world > 1:
            rec.extra["rank"] = rank
        store(rec)

    run_cells(backend, todo, prepared, prefix_reuse=prefix_reuse, batch_size=batch_size)


@dataclass(frozen=True)
class _WorkerJob:
    """What every worker process of a CPU sweep shares: the run (its configuration bound to the
    backend's identity, whose ``backend_ref`` each worker loads), torch threads per process,
    the sweep's batching settings and the job shard the workers compute part of."""

    config: SweepConfig
    out: Path
    threads: int
    prefix_reuse: bool
    batch_size: int
    shard: Shard | None = None


def _worker(rank: int, world: int, todo: list[Cell], job: _WorkerJob, messages) -> None:
    """One worker process of a CPU sweep (:func:`_compute_in_workers`): ``job.threads`` torch
    threads, its own backend, its cells appended to ``results.rank{rank}.jsonl`` (a job shard's
    ``results.shard{i}of{N}.rank{rank}.jsonl``). It puts
    ``("record", SweepRecord)`` on ``messages`` for each stored cell, then ``("done", rank)``, or
    ``("error", (exception, traceback text))`` when it fails."""
    import os

    from ragfix.models.device import THREADS_ENV, exit_with_parent

    exit_with_parent()
    os.environ[THREADS_ENV] = str(job.threads)
    try:
        backend = job.config.backend_ref.load(shared=False)
        folder = sweep_folder(job.out, job.config, rank, world)
        if job.shard is not None:
            folder.write_shard(job.shard)
        folder.bind(backend.identity())  # the weights may have changed since the parent's check

        def store(rec: SweepRecord) -> None:
            folder.append(rec.model_dump())
            messages.put(("record", rec))

        _compute(
            todo,
            backend,
            store,
            rank=rank,
            world=world,
            log_prompts=job.config.log_prompts,
            prefix_reuse=job.prefix_reuse,
            batch_size=job.batch_size,
        )
    except Exception as e:  # handed to the parent, which raises it
        import pickle
        import traceback

        trace = traceback.format_exc()
        try:
            pickle.dumps(e)
        except Exception:  # an exception that cannot cross processes: its text does
            e = RuntimeError(f"{type(e).__name__}: {e}")
        messages.put(("error", (e, trace)))
    else:
        messages.put(("done", rank))


def _compute_in_workers(
    todo: list[Cell], workers: int, track: Callable[[SweepRecord], None], job: _WorkerJob
) -> None:
    """Compute ``todo`` in ``workers`` fresh (spawned) processes, each on its share of whole
    samples (:func:`_my_share`, as the ranks of a launcher), passing every record to ``track`` in
    this process as it arrives. The first worker error (or a worker that dies) stops all of them
    and is raised here, as is Ctrl-C; every cell stored before stays for the rerun.

    Raises:
        RagfixError: a worker's own one-line error (a bad setting, changed weights), as it is.
        WorkerError: a worker process died without reporting (killed, out of memory), or failed
            with another exception (its traceback is written to ``worker{rank}.log`` in the run
            folder and named in the message).
    """
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, workers, _my_share(todo, rank, workers), job, messages),
            daemon=True,
        )
        for rank in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        running = set(range(workers))
        while running:
            try:
                kind, value = messages.get(timeout=1.0)
            except queue.Empty:
                # exit code 0: the worker's last message is still on its way
                dead = [r for r in running if procs[r].exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(
                        f"sweep worker {dead[0]} died (exit code {procs[dead[0]].exitcode}); "
                        "finished results are saved: rerun the same command to compute its "
                        "remaining cells"
                    ) from None
                continue
            if kind == "record":
                track(value)
            elif kind == "done":
                running.discard(value)
            else:
                raise _worker_failure(value[0], value[1], job.out)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


def _worker_failure(error: Exception, trace: str, out: Path) -> RagfixError:
    """The error to raise for a worker's exception: a :class:`RagfixError` as it is, anything
    else as a :class:`WorkerError` whose traceback goes to ``out/worker-error.log``."""
    if isinstance(error, RagfixError):
        return error
    log = out / WORKER_LOG
    atomic_write_text(log, trace)
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return WorkerError(
        f"a sweep worker failed: {type(error).__name__}: {first} (traceback in {log}); finished "
        "results are saved"
    )


class SweepRun(RunKind):
    """The position sweep as a run kind (:func:`ragfix.eval.run.run`): its cells are the
    samples with the gold passage at each position (:func:`~ragfix.eval.sweep.plan_cells`),
    computed in this process, in worker processes (each on its share of whole samples) or, under
    a launcher, each rank on its share; the summary is :func:`~ragfix.eval.sweep_summary.
    write_report` of the run's cells, written by rank 0 once every rank is done."""

    def __init__(
        self,
        config: SweepConfig,
        cells: list[Cell],
        *,
        workers: int,
        state,
        prefix_reuse: bool,
        skipped: SkipCounter,
        on_record: Callable[[SweepRecord], None] | None,
    ) -> None:
        self.config, self._cells, self.workers, self.state = config, cells, workers, state
        self.rank, self.world = (state.process_index, state.num_processes) if state else (0, 1)
        self.main = self.rank == 0
        self.prefix_reuse, self.skipped = prefix_reuse, skipped
        self.on_record = on_record
        self.label = f"{config.backend} sweep"

    def folder(self, out: Path) -> RunFolder:
        self.run_folder = sweep_folder(out, self.config, self.rank, self.world)
        return self.run_folder

    def setup(self, backend) -> None:
        _check_budget(backend, self.config)
        self.backend = backend

    def bind(self, folder: RunFolder, restart: bool) -> None:
        # one rank restarts a shared folder; the others check it afterwards
        folder.bind(self.backend.identity(), restart=restart and self.rank == 0)
        if self.state is not None and restart:
            self.state.wait_for_everyone()
            folder.bind(self.backend.identity())

    def cells(self) -> list[tuple[str, Cell]]:
        return [(c.cell_id, c) for c in self._cells]

    def split(
        self, cells: list[tuple[str, Cell]], index: int, count: int
    ) -> list[tuple[str, Cell]]:
        """Whole samples (their positions share a prompt prefix), balanced by prompt length."""
        return [(c.cell_id, c) for c in _my_share([c for _, c in cells], index, count)]

    def share(self, todo: list[tuple[str, Cell]]) -> list[tuple[str, Cell]]:
        return self.split(todo, self.rank, self.world)

    def batch_size(self, on_gpu: bool) -> int:
        """16 on CUDA or where the cells of a sample share a prefix cache (prefilled along their
        token trie, then decoded together: the fastest exact mode on the CPU too,
        ``results/bench-sweep-nq10.json``), 1 otherwise."""
        trie = self.prefix_reuse and self.backend.supports_prefix_reuse
        return 16 if on_gpu or trie else 1

    def compute(self, todo: list[Cell], store: Store, batch_size: int) -> None:
        def passed_on(rec: SweepRecord) -> None:
            if self.on_record is not None:
                self.on_record(rec)

        n = min(self.workers, len({c.sample.id for c in todo}))
        if n > 1:
            self.backend = None  # each worker loads its own copy
            gc.collect()
            threads = threads_per_worker()
            if self.console is not None:
                self.console.print(f"{n} worker processes, {threads} torch thread(s) each")
            out, config = self.run_folder.out, self.run_folder.config
            job = _WorkerJob(config, out, threads, self.prefix_reuse, batch_size, self.shard)

            def arrived(rec: SweepRecord) -> None:
                store.arrived(rec.model_dump())
                passed_on(rec)

            _compute_in_workers(todo, n, arrived, job)
            return

        def stored(rec: SweepRecord) -> None:
            store(rec.model_dump())
            passed_on(rec)

        _compute(
            todo,
            self.backend,
            stored,
            rank=self.rank,
            world=self.world,
            log_prompts=self.config.log_prompts,
            prefix_reuse=self.prefix_reuse,
            batch_size=batch_size,
        )

    def summarize(self, folder: RunFolder, records: list[dict]) -> dict:
        if self.state is not None:
            self.state.wait_for_everyone()
            if self.rank != 0:
                return {}
        merge_shards(folder.out)
        done = open_store(folder.out).load()
        mine = [done[c.cell_id] for c in self._cells if c.cell_id in done]
        scored, counts = summary_counts(mine)
        return write_report(folder.out, scored, {"skipped_records": self.skipped.count, **counts})


def run_sweep(
    data: str | Path,
    out: str | Path,
    *,
    model: str = "smollm2",
    backend: str | Backend | BackendRef = "vanilla",
    adapter: str | Path | None = None,
    backend_options: dict | None = None,
    orders: dict | None = None,
    task: str | None = None,
    repeat: str = "none",
    references: bool | None = None,
    num_docs: int = 10,
    positions: str = "all",
    records: str | None = None,
    limit: int | None = None,
    batch_size: int | None = None,
    prefix_reuse: bool = True,
    skip_invalid: bool = False,
    distractor_pool: str | Path | None = None,
    workers: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    restart: bool = False,
    shard: str | Shard | None = None,
    log_prompts: bool = True,
    on_record: Callable[[SweepRecord], None] | None = None,
    console: Console | None = None,
) -> dict:
    """Accuracy as the gold passage moves through every position (Liu et al., "Lost in the
    Middle", TACL 2024, Sec. 2): every sample with its gold passage at every requested position,
    one greedy answer per cell, scored by the task's scorer (:mod:`ragfix.tasks`).

    Args:
        data: a Lost-in-the-Middle QA or KV file (``.jsonl``, ``.jsonl.gz``) or a bundled sample
            (``nq-sample``, ``kv-sample``).
        out: the run folder: ``config.json``, ``results.jsonl`` (one record per cell, appended,
            resumable), ``summary.json`` and ``curve.png``.
        model: ``smollm2`` (embedded), a hub id, a folder, a ``.gguf``, or ``openai:NAME`` (a
            served model; ``backend_options`` then holds
            :class:`~ragfix.backends.remote.RemoteOptions`, whose call settings are left out
            of the configuration so a rerun with other ones resumes).
        backend: a registered backend (:func:`ragfix.backends.backend_names`); a
            :class:`~ragfix.backends.BackendRef` (what the CLI's backend options build); or a
            loaded backend (as lm-eval's ``simple_evaluate`` takes a loaded model), computed in
            this process. A reference and a loaded backend bring their own model, options,
            adapter, orders, device and dtype (:func:`~ragfix.eval.run.backend_reference`), so
            ``model``, ``adapter``, ``backend_options``, ``orders``, ``device`` and ``dtype``
            are not given with them; a folder one of the three wrote resumes under the others.
        adapter: a LoRA adapter folder applied under any backend.
        backend_options: the backend's options (validated before anything is loaded); they and
            the adapter path are part of the cell ids.
        orders: order marginalization's settings
            (:class:`~ragfix.backends.orders.OrderOptions`: ``orders``, ``design``,
            ``aggregate``, ``seed``): each cell answered over several orders of its passages,
            every order's answer kept in the record (``extra["votes"]``); validated before
            anything is loaded, part of the cell ids (as ``backend_options["orders"]``) and of
            the backend's identity. ``None``: one order, as placed.
        task: the task the records are read as (:func:`ragfix.tasks.task_names`; one of the
            data file's format: ``qa``, ``qa-extractive``, ``qa-extractive-2shot`` for QA
            records), part of the configuration with its fingerprint; ``None``: ``qa`` or
            ``kv`` as the file's format (:func:`ragfix.tasks.resolve_task`).
        repeat: read the passages (``passages``) or the whole prompt (``prompt``) twice, a
            prompt-level correction for the plain model, an adapter or a served model
            (:attr:`ragfix.tasks.Task.repeat`): the
            task becomes ``TASK:repeat-MODE``; ``none``: once. Not with ``orders`` nor a backend
            that reads the passages where the prompt says they are (they would take the two
            copies for more passages).
        references: also run each sample's reference points, closed-book and oracle
            (:data:`~ragfix.eval.sweep.REFERENCES`), summarised apart from the curve
            (``summary.json``'s ``references``); ``None``: for QA tasks, not for KV.
        num_docs: passages (documents or KV pairs) per prompt.
        positions: ``all``, ``first,middle,last`` or ``0,4,9`` (0-based gold positions).
        records: a record range of the file, ``"START:END"`` (0-based, END excluded; record
            ``i`` is on line ``i + 1``), applied before ``limit``; written to ``config.json``
            (choices made on one range are reported on a disjoint one). The whole file is
            read (and must be valid, or ``skip_invalid``) so distractors never depend on it.
        limit: use the first ``limit`` samples (of the range).
        batch_size: cells per batch (default :func:`~ragfix.eval.run.default_batch_size`: a
            remote model's concurrency; 1 for a bf16 or fp16 model on the CPU; else 16 on CUDA
            or with prefix reuse, 1 otherwise).
        prefix_reuse: run the positions of a sample over the KV cache of their shared prompt
            prefix (same answers, fewer prefill tokens): one cell at a time at batch size 1;
            above it the cells of a sample prefilled the same way, then decoded in one batch
            (:func:`ragfix.eval.sweep.run_cells`).
        skip_invalid: skip and count malformed records instead of stopping.
        distractor_pool: draw QA distractors from this file (BM25) instead of the sample's own.
        workers: worker processes, each on its share of whole samples with
            :func:`~ragfix.eval.shard.threads_per_worker` torch threads (default:
            :func:`~ragfix.eval.shard.sweep_workers`, one per free core for a local model on
            the CPU); ranks of a launcher run one each.
        device, dtype: see :func:`ragfix.backends.load_backend` (under a launcher, each rank's
            own device).
        shard: compute one job's part of the run only, ``"i/N"`` or a
            :class:`~ragfix.eval.shard.Shard` (0-based): its own result file in ``out``, its
            manifest, no summary (it returns a :class:`~ragfix.eval.run.ShardDone`); join the
            shards with :func:`~ragfix.eval.merge.merge_runs`.
        restart: start ``out`` over (its cells, configuration and summary removed) when it
            holds a run of other settings, weights or inputs, instead of refusing it.
        log_prompts: keep in each record the prompt its model read (the user turn and the
            passage spans, about the prompt's size a cell: leave them out of very large runs);
            the question and gold answers are kept either way. Not part of the cell ids, but
            part of the configuration: a folder's cells all keep their prompts or none do.
        on_record: called with each newly computed :class:`SweepRecord` once it is stored.
        console: where progress and notes go (``None``: quiet).

    Returns:
        the summary (as written to ``summary.json``, with ``flags``: ``{flag: {position or
        reference point: cells}}``, ``cells`` and ``scored_cells`` (the curve's),
        ``excluded_samples``, ``references``: closed-book and oracle per curve when they ran);
        ``{}`` on ranks other than 0.

    Raises:
        DataError: a missing file, a malformed record, no record in ``records``.
        ConfigError: unknown backend or task, a task of the other data format, a repeated task
            with ``orders`` or a passage method, bad positions or record range, ``limit``,
            ``batch_size`` or ``workers`` < 1, more than one worker off the CPU, a missing
            adapter for an adapter backend, an answer budget that fills the model's window,
            more ``orders`` than ``num_docs`` passages have distinct orders
            (:func:`~ragfix.backends.orders.check_orders`).
        ConfigMismatchError: ``out`` holds results of other settings, weights (the backend's
            identity: weights, adapter, calibration, chat template) or input contents (data file,
            distractor pool), or was written before run folders recorded them (not with
            ``restart``).
        WorkerError: a worker process died or failed with an unexpected exception.
        Interrupted: Ctrl-C, once every answer that had arrived is stored; its message says how
            many cells this run stored.
        ModelNotFoundError: the model cannot be found.
        pydantic.ValidationError: an unknown or invalid backend option; ``num_docs`` < 1.
    """
    from ragfix.backends import backend_class, result_options
    from ragfix.backends.orders import OrderOptions, check_orders
    from ragfix.connectors.litm import detect_format, load_samples
    from ragfix.models.resolve import resolve_model

    ref, loaded = backend_reference(
        backend, model=model, adapter=adapter, backend_options=backend_options, orders=orders,
        device=device, dtype=dtype,
    )  # fmt: skip
    if loaded is not None:
        if workers not in (None, 1):
            raise ConfigError("a loaded backend runs in this process: no worker processes")
        workers = 1
    backend, model, adapter, orders, device = (
        ref.name,
        ref.model,
        ref.adapter,
        ref.orders,
        ref.device,
    )
    out, options = Path(out), ref.options
    for name, value in (("--limit", limit), ("--batch-size", batch_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} {value} < 1: give at least 1")
    rng = parse_records(records) if records is not None else None
    path = _resolve_data(data)
    pool = Path(distractor_pool).resolve() if distractor_pool else None
    order_options = None if orders is None else OrderOptions(**orders)
    if order_options is not None:
        check_orders(order_options, num_docs)
    resolve_model(model)  # unknown model / default not installed: fail before any work
    state = distributed_state()
    ref = ref.model_copy(
        update={
            "orders": order_options.model_dump() if order_options else None,
            "device": str(state.device) if state is not None else device,
        }
    )
    reads = orders is not None or backend_class(backend, model).needs_passage_spans
    the_task = resolve_task(task, repeat, detect_format(path), reads_passages=reads)
    config = SweepConfig(
        data=str(path.resolve()),
        task=the_task.name,
        task_form=the_task.fingerprint(),
        num_docs=num_docs,
        model=model,
        backend=backend,
        backend_options={
            **result_options(options, ref.validated),
            **({"adapter": str(adapter)} if adapter else {}),
            **({"orders": order_options.model_dump()} if order_options else {}),
        },
        distractor_pool=str(pool) if pool else None,
        records=records,
        log_prompts=log_prompts,
        inputs=input_fingerprints(data=path, distractor_pool=pool),
        backend_ref=ref,
    )
    pos = parse_positions(positions, num_docs)
    skipped = SkipCounter()
    samples = load_samples(
        path, num_docs, limit, distractor_pool, skip_invalid, skipped, rng, task=the_task.name
    )
    if rng is not None and not samples:
        raise DataError(path, None, None, f"no usable record in --records {records}")
    n = sweep_workers(workers, device=device, model=model, samples=len(samples))
    kind = SweepRun(
        config,
        plan_cells(
            config, samples, pos, the_task.data_format == "qa" if references is None else references
        ),
        workers=n,
        state=state,
        prefix_reuse=prefix_reuse,
        skipped=skipped,
        on_record=on_record,
    )
    return run(
        kind,
        ref if loaded is None else loaded,
        out,
        restart=restart,
        batch_size=batch_size,
        shard=Shard.parse(shard),
        console=console,
    )


__all__ = ["run_sweep"]
