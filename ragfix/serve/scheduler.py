"""The model thread of ``ragfix serve``: one thread owns the backend and computes the model work
of requests (:class:`Job`) in arrival order (:class:`ModelWorker`). Answers are decoded with
continuous batching where the backend decodes step by step (a request joins the running batch
at the next decoding step; a finished one leaves it), else in whole batches of compatible
answers; a job whose client is gone is dropped or stopped within one decoding step."""

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

#: most answers decoded together (rows of a decoding step, or answers of a whole batch): the
#: measured better of 8 and 16 on a 2-core CPU (``ragfix bench serve``, results/serve-load.json
#: at 8 and results/serve-load-b16.json at 16: the same at 8 clients, more at 16)
DEFAULT_MAX_BATCH_SIZE = 16
#: how long the first answer of a whole batch (a backend that does not decode step by step)
#: waits for others to join it (milliseconds), from its arrival or from when the model is free
#: (:meth:`ModelWorker._take`): on a busy 2-core CPU the clients of a batch of 8 were back
#: 13-16 ms after it was answered
DEFAULT_MAX_WAIT_MS = 25.0


_END = object()


@dataclass(eq=False)
class Job:
    """One piece of model work, made on the event loop and computed on the model thread.

    Attributes:
        loop: the event loop that awaits it.
        run: the work (``cancel`` -> result), for a job that is not batched.
        prompt, key: an answer decoded by the model thread: its prompt and ``(budget, stop
            rule, first_logprobs)``; under continuous batching any answers share a decoding step,
            else jobs with the same key are batched.
        stream: the answer is streamed: its text is emitted as it grows, a step at a time
            (:meth:`emit`); its result is the answer's :class:`~ragfix.types.Generation` under
            continuous batching (its tokens counted as decoded), else ``None``.
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
    stream: bool = False
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
    """The thread that owns the backend: takes jobs in arrival order, decodes answers through
    the backend's :meth:`~ragfix.backends.base.Backend.decoder`, and computes under
    :attr:`lock` (held while it has work: rows decoding, a job running).

    Continuous batching (a :attr:`~ragfix.backends.base.Decoder.continuous` decoder: a backend
    that :attr:`~ragfix.backends.base.Backend.supports_step_decoding`): the thread loops over
    admitting the queued answers, streamed or not, whatever their rules, up to
    ``max_batch_size`` rows (each is prefilled as it joins) -> one decoding step of every row
    -> the finished rows' results and the streams' new text handed to their loops -> the rows
    whose clients are gone dropped. A request that arrives while others decode joins them at
    the next step and never waits for the batch to end. Other jobs (prompt scoring) run
    between two steps, in their arrival order.

    Otherwise (a whole-batch decoder): the first queued answer and the queued ones with its key
    (up to ``max_batch_size``) are answered together by one ``generate`` call, the first
    waiting up to ``max_wait_ms`` for company (:meth:`_take`); streams run one at a time
    through ``Backend.stream`` (:class:`~ragfix.serve.server.Server`).

    Args:
        backend: the served backend.
        prefix_reuse: passed to ``Backend.decoder``.
        max_batch_size: most rows decoded together (1 where the backend does not
            :attr:`~ragfix.backends.base.Backend.supports_batching`).
        max_wait_ms: how long a whole batch's first job waits for others, from its arrival or,
            when it arrived while the model was busy, from when the model is free; not used
            under continuous batching, where a request joins the running batch at the next
            step.

    Attributes:
        continuous: whether answers are decoded with continuous batching.
        batch_sizes: the rows of each decoding step (continuous) or the answers of each whole
            batch so far.
    """

    def __init__(
        self, backend: Backend, prefix_reuse: bool, max_batch_size: int, max_wait_ms: float
    ):
        self.backend = backend
        self.decoder = backend.decoder(prefix_reuse)
        self.continuous = self.decoder.continuous
        self.max_batch_size = max_batch_size if backend.supports_batching else 1
        self.max_wait = max_wait_ms / 1000
        self.lock = threading.Lock()
        self._queue: list[Job] = []
        self._ready = threading.Condition()
        self._rows: dict[int, Job] = {}  # decoder row -> its job
        self._shown: dict[int, str] = {}  # decoder row -> the text streamed so far
        self.batch_sizes: list[int] = []
        threading.Thread(target=self._loop, name="ragfix-model", daemon=True).start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (event loop)."""
        with self._ready:
            self._queue.append(job)
            self._ready.notify()

    def _take(self, block: bool) -> list[Job]:
        """The next jobs to start, removed from the queue (cancelled ones are dropped): a job
        that is not an answer, alone; under continuous batching, the queued answers before the
        next other job, up to the free rows; else the first answer and the queued ones with its
        key (up to the batch size) once the decoder is empty, waiting until the batch is full or
        ``max_wait`` is over, counted from the first job's arrival or, for a job that arrived
        while the model was busy, from now (the model free): the clients of the batch just
        answered then join it with their next requests. Without ``block``, ``[]`` rather than
        waiting for a job or for company."""
        free = time.monotonic()
        with self._ready:
            while True:
                for job in [j for j in self._queue if j.cancel.is_set()]:
                    self._queue.remove(job)
                    job.settle(error=Cancelled())
                if not self._queue:
                    if not block:
                        return []
                    self._ready.wait()
                    continue
                first = self._queue[0]
                room = self.max_batch_size - len(self.decoder)
                if first.key is None:
                    group = [first]
                elif self.continuous:
                    group = []
                    for job in self._queue[: max(room, 0)]:
                        if job.key is None:
                            break
                        group.append(job)
                elif len(self.decoder):
                    return []
                else:
                    group = [j for j in self._queue if j.key == first.key][: self.max_batch_size]
                    left = max(first.arrived, free) + self.max_wait - time.monotonic()
                    if len(group) < self.max_batch_size and left > 0:
                        if not block:
                            return []
                        self._ready.wait(left)
                        continue
                for job in group:
                    self._queue.remove(job)
                return group

    def _loop(self) -> None:
        while True:
            jobs = self._take(block=True)
            with self.lock:
                self._start(jobs)
                while len(self.decoder):
                    self._step()
                    self._start(self._take(block=False))

    def _start(self, jobs: list[Job]) -> None:
        """Run a job that is not an answer; add answers to the decoder (an answer whose prompt
        cannot be read fails alone)."""
        for job in jobs:
            try:
                if job.key is None:
                    job.settle(job.run(job.cancel))
                    continue
                budget, stop, logprobs = job.key
                row = self.decoder.add(job.prompt, budget, stop, logprobs, cancel=job.cancel)
            except Exception as e:
                job.settle(error=e)
                continue
            self._rows[row] = job

    def _step(self) -> None:
        """Drop the rows whose clients are gone, run one decoding step, stream the new text
        and hand the finished rows' results to their loops."""
        for row, job in list(self._rows.items()):
            if job.cancel.is_set():
                self._finish(row)
                self.decoder.drop(row)
                job.settle(error=Cancelled())
        if not len(self.decoder):
            return
        self.batch_sizes.append(len(self.decoder))
        done = self.decoder.step()
        for row, job in self._rows.items():
            if job.stream and not isinstance(done.get(row), Exception):
                self._emit(row, job, done.get(row))
        for row, result in done.items():
            job = self._finish(row)
            if isinstance(result, Exception):
                job.settle(error=result)
            else:
                job.settle(result)

    def _finish(self, row: int) -> Job:
        self._shown.pop(row, None)
        return self._rows.pop(row)

    def _emit(self, row: int, job: Job, result) -> None:
        """Emit the text a streamed row has added since the last step: its tokens decoded (the
        answer's, once finished), cut before the first newline after leading white space with
        the newline rule; a trailing partial character is held back until the answer ends,
        which then ends as the same answer not streamed does (``\ufffd`` for a character cut
        by ``max_tokens``)."""
        from ragfix.backends.base import cut_at_newline

        tokens = self.decoder.tokens(row) if result is None else result.token_ids
        text = self.backend.detokenize(tokens)
        if job.key[1]:
            text = "".join(cut_at_newline(iter([text])))
        if result is None:
            text = text.rstrip("\ufffd")
        shown = self._shown.get(row, "")
        if len(text) > len(shown) and text.startswith(shown):
            job.emit(text[len(shown) :])
            self._shown[row] = text


__all__ = ["DEFAULT_MAX_BATCH_SIZE", "DEFAULT_MAX_WAIT_MS", "Job", "ModelWorker"]
