"""The model thread of ``ragfix serve``: one thread owns the backend and computes the model work
of requests (:class:`Job`) in arrival order, batching compatible answers
(:class:`ModelWorker`); a job whose client is gone is dropped or stopped within one decoding
step."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ragfix.errors import Cancelled

if TYPE_CHECKING:
    from ragfix.backends.base import Backend, Cancel, Prompt

#: most answers computed in one batch
DEFAULT_MAX_BATCH_SIZE = 8
#: how long the first request of a batch waits for others to join it (milliseconds), from its
#: arrival or from when the model is free (:meth:`ModelWorker._take`): on a busy 2-core CPU the
#: clients of a batch of 8 were back 13-16 ms after it was answered
DEFAULT_MAX_WAIT_MS = 25.0


class _AllSet:
    """A :class:`~ragfix.backends.base.Cancel` set once every one of ``signals`` is."""

    def __init__(self, signals: list[threading.Event]):
        self.signals = signals

    def is_set(self) -> bool:
        return all(s.is_set() for s in self.signals)


_END = object()


@dataclass(eq=False)
class Job:
    """One piece of model work, made on the event loop and computed on the model thread.

    Attributes:
        loop: the event loop that awaits it.
        run: the work (``cancel`` -> result), for a job that is not batched.
        prompt, key: a batchable answer: its prompt and ``(budget, stop rule, first_logprobs)``;
            jobs with the same key are batched.
        cancel: set when the client is gone (or the response is over); the model thread drops
            a queued job and stops a running one within a decoding step.
        arrived: when it was made (``time.monotonic``): a batch's first job waits for others
            from then, or from when the model is free if that is later.
        result: the outcome, on ``loop``; a streaming ``run`` also emits pieces (:meth:`emit`),
            read by :meth:`pieces`.
    """

    loop: asyncio.AbstractEventLoop
    run: Callable[[Cancel], Any] | None = None
    prompt: Prompt | None = None
    key: tuple | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.result: asyncio.Future = self.loop.create_future()
        self._pieces: asyncio.Queue = asyncio.Queue()

    def _call(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping
            self.loop.call_soon_threadsafe(fn, *args)

    def emit(self, piece: str) -> None:
        """Hand a streamed piece to the loop (model thread)."""
        self._call(self._pieces.put_nowait, piece)

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the loop (model thread); a cancelled job's is dropped."""

        def done():
            if self.result.done():
                return
            if error is not None and not self.cancel.is_set():
                self.result.set_exception(error)
            else:
                self.result.set_result(value)
            self._pieces.put_nowait(_END)

        self._call(done)

    async def pieces(self) -> AsyncIterator[str]:
        """The streamed pieces as they come; raises what the work raised, at the end."""
        while (piece := await self._pieces.get()) is not _END:
            yield piece
        self.result.result()


class ModelWorker:
    """The thread that owns the backend: takes jobs in arrival order, batches compatible
    answers, and computes under :attr:`lock`.

    Args:
        backend: the served backend.
        prefix_reuse: passed to ``Backend.generate``.
        max_batch_size: most answers per batch (1 where the backend does not
            :attr:`~ragfix.backends.base.Backend.supports_batching`).
        max_wait_ms: how long a batch's first job waits for others, from its arrival or, when
            it arrived while the model was busy, from when the model is free (:meth:`_take`).
    """

    def __init__(
        self, backend: Backend, prefix_reuse: bool, max_batch_size: int, max_wait_ms: float
    ):
        self.backend, self.prefix_reuse = backend, prefix_reuse
        self.max_batch_size = max_batch_size if backend.supports_batching else 1
        self.max_wait = max_wait_ms / 1000
        self.lock = threading.Lock()
        self._queue: list[Job] = []
        self._ready = threading.Condition()
        #: sizes of the batches run so far (answers per ``generate`` call)
        self.batch_sizes: list[int] = []
        threading.Thread(target=self._loop, name="ragfix-model", daemon=True).start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (event loop)."""
        with self._ready:
            self._queue.append(job)
            self._ready.notify()

    def _take(self) -> list[Job]:
        """The next jobs to run together: the first queued job and, if it is a batchable
        answer, the queued ones with its key (up to the batch size), waiting until the batch is
        full or ``max_wait`` is over, counted from the first job's arrival or, for a job that
        arrived while the model was busy, from now (the model free): the clients of the batch
        just answered then join it with their next requests, rather than a job that waited
        through a batch always running alone. Cancelled jobs are dropped."""
        free = time.monotonic()
        with self._ready:
            while True:
                for job in [j for j in self._queue if j.cancel.is_set()]:
                    self._queue.remove(job)
                    job.settle(error=Cancelled())
                if not self._queue:
                    self._ready.wait()
                    continue
                first = self._queue[0]
                group = [j for j in self._queue if first.key is not None and j.key == first.key]
                group = group[: self.max_batch_size] or [first]
                left = max(first.arrived, free) + self.max_wait - time.monotonic()
                if first.key is None or len(group) >= self.max_batch_size or left <= 0:
                    for job in group:
                        self._queue.remove(job)
                    return group
                self._ready.wait(left)

    def _loop(self) -> None:
        while True:
            group = self._take()
            with self.lock:
                self._run(group)

    def _run(self, group: list[Job]) -> None:
        first = group[0]
        try:
            if first.key is None:
                first.settle(first.run(first.cancel))
                return
            budget, stop, logprobs = first.key
            self.batch_sizes.append(len(group))
            gens = self.backend.generate(
                [j.prompt for j in group],
                batch_size=len(group),
                max_new_tokens=budget,
                stop_at_newline=stop,
                first_logprobs=logprobs,
                prefix_reuse=self.prefix_reuse,
                cancel=_AllSet([j.cancel for j in group]),
            )
        except Exception as e:
            if len(group) > 1 and not isinstance(e, Cancelled):
                for job in group:  # one prompt's failure is not the others'
                    self._run([job])
                return
            for job in group:
                job.settle(error=e)
            return
        for job, gen in zip(group, gens, strict=True):
            job.settle(gen)


__all__ = ["DEFAULT_MAX_BATCH_SIZE", "DEFAULT_MAX_WAIT_MS", "Job", "ModelWorker"]
