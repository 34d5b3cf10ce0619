"""Drawing the next step's noise on a worker thread while the model computes.

On a CPU, drawing N(0, σ²C²) for every coordinate is not free: torch's Mersenne Twister and
Box–Muller cost about 3 ns per coordinate, which for a small model (a 670 000-parameter MLP at
batch size 256) is a fifth of a non-private step. The noise does not depend on the data, so it
can be drawn *before* the gradients exist: :class:`NoiseAhead` starts the draw for the next
logical batch on a worker thread when the optimizer's ``zero_grad()`` opens it, and the forward
and backward passes run meanwhile (torch releases the interpreter lock inside its kernels). The
private optimizer then takes the finished buffers and has the engine add the clipped sum *into*
them, so the step holds no second parameter-sized buffer.

That needs a core the model leaves idle: with one torch thread (``torch.set_num_threads(1)``)
on a machine with more cores. When torch's own threads use every core, a draw running beside
them would only stall them (torch's idle threads spin-wait for the next kernel), so each draw
instead runs on the training thread when it is needed; the noise is the same either way.

Buffers drawn ahead are held through the forward and backward passes, next to the activations
the engine keeps for its clipped sums. So the parameters of the layer the engine sums last are
not drawn ahead: :meth:`NoiseAhead.fill` fills their running sum during the clip phase, block by
block of rows (:func:`dpfy.grads.registry.row_blocks`), while the engine adds the product into
the rows already filled (or sums the layer before); :meth:`NoiseAhead.add_later` adds noise into
a sum formed over several physical batches instead, drawing the same blocks, so both give the
same noise. The first rows that product needs are drawn a little earlier, during the product
of the layer summed before (:meth:`NoiseAhead.prepare_head`: the first ``HEAD_BLOCKS`` blocks of
one parameter, into a tensor of their own): the product then starts at once, and the worker,
still awake, stays ahead of it from then on. They are the first numbers that parameter's fill
would have drawn.

Each time the worker wakes or finishes a kernel it must take the interpreter lock; if the
training thread is between two short kernels then, it finds the lock taken and sleeps until
the worker lets go, which on the project's 2-core virtual machine costs it 50-100 µs each time.
So work is handed to the worker where the training thread is about to run a long kernel (the
head: as the product of the layer before starts, not among the norms' short kernels, which cost
about four such waits a step on the MLP benchmark), and in few pieces.

What this must not break:

- every draw is used at most once — a draw that is not taken (a refused or failed step, a model
  moved to another device) is dropped, never handed out again;
- a checkpoint saved while a draw is waiting stores the generator state from *before* that
  draw, so a resumed run draws exactly what an uninterrupted one would have;
- one stream order: every draw, fill and addition runs in the order it was asked, whether on
  the worker or on the training thread (which draws only while the worker has nothing queued);
- nothing about the draw depends on data: shapes, dtypes, devices and the std only.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dpfy.grads.registry import row_blocks
from dpfy.noise import NoiseSource

__all__ = ["NoiseAhead"]

#: Blocks of a fill the training thread draws itself while an idle worker wakes up.
FIRST_BLOCKS_HERE = 2

#: Row blocks drawn early (during the product of the layer before) for the parameter filled
#: first, its head: with ``row_blocks``' doubling sizes, a quarter of its rows or a little more
#: (168 of the MLP's 512). The worker draws about 1.6x as fast as the product uses the rows on
#: the MLP benchmark, so it needs a lead of about the next block; with 3 blocks the product still
#: waited, with 4 it did not (one thread). The head is held while that parameter's sum is opened
#: and copied into it; the optimizer caps its size (``prepare_head(max_values=...)``).
HEAD_BLOCKS = 4

#: What a draw is for: each parameter's name, shape, dtype and device, and the std.
_Key = tuple[tuple[tuple[str, torch.Size, torch.dtype, torch.device], ...], float]


@dataclasses.dataclass(frozen=True)
class _Head:
    """The noise of a parameter's first row blocks, being drawn by ``job``."""

    name: str
    rows: Tensor
    job: _Fill


class _Draw:
    """One draw of noise buffers, run by the worker thread; the source's state before it."""

    def __init__(self, source: NoiseSource, key: _Key) -> None:
        self.source, self.key = source, key
        self.state_before: Any = None
        # Allocated by the training thread: memory then comes from (and returns to) its own
        # allocator arena, which the rest of the step reuses; a worker's arena would be grown
        # and trimmed back every step, and pages faulted in again.
        self.buffers = _empty_buffers(key)
        self.streams = _current_streams(self.buffers.values())
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        """Note the source's state, fill every buffer; keep an error for the thread that waits."""
        try:
            self.state_before = _state_of(self.source)
            with _on_streams(self.streams):
                _fill(self.source, self.buffers, self.key[1])
        except BaseException as error:  # re-raised by result() in the training thread
            self.error = error
        finally:
            self._done.set()

    def wait(self) -> None:
        """Block until the worker has finished this draw."""
        self._done.wait()

    def result(self) -> dict[str, Tensor]:
        """Wait for the draw; its buffers, or its error raised here."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self.buffers


class _Fill:
    """Fills a running sum with noise (or adds noise into it), block by block of rows.

    Filling and adding draw the same blocks in the same order, so a parameter gets the same
    noise whichever of the two it needs (one physical batch, or several: virtual batching).
    Other threads wait for rows to be ready.
    """

    def __init__(
        self,
        source: NoiseSource,
        out: Tensor,
        std: float,
        *,
        add: bool,
        start: int = 0,
        blocks: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """``start``: rows that hold their noise already (a head put in by the training thread).

        ``blocks``: the blocks to draw, if not ``out``'s own (a head: a larger tensor's first).
        """
        self.source, self.std, self.add = source, std, add
        self._rows, self._blocks = _by_rows(out)
        if blocks is not None:
            self._blocks = blocks
        self.rows = self._rows.shape[0]
        self.streams = _current_streams([out])
        self.filled = start
        self.error: BaseException | None = None
        self._progress = threading.Condition()
        self._handoff: threading.Event | None = None

    def run(self) -> None:
        """Fill (or add into) each remaining block of rows in order, announcing each one.

        On the worker, after the training thread handed over (see :meth:`hand_over_after`).
        """
        if self._handoff is not None:
            self._handoff.wait()
        try:
            self._draw(len(self._blocks))
        finally:
            self._rows = None  # type: ignore[assignment]  # the sum is not kept alive here

    def hand_over_after(self, count: int, submit: Callable[[_Fill], None]) -> None:
        """Queue the job, draw its first ``count`` blocks on this thread, then hand it over.

        For a worker that is idle, so asleep: it wakes while this thread draws the first
        blocks (about 0.2 ms on the project's machine), and the product of those blocks then
        overlaps the worker's draw of the next ones instead of waiting for it to wake.
        """
        self._handoff = threading.Event()
        submit(self)
        try:
            self._draw(count)
        finally:
            self._handoff.set()

    def _draw(self, upto: int) -> None:
        """Draw the blocks from the first not yet done up to block ``upto``; keep an error."""
        try:
            with torch.no_grad(), _on_streams(self.streams):
                for start, stop in self._blocks[:upto]:
                    if stop <= self.filled or self.error is not None:
                        continue
                    _draw_block(self.source, self._rows[start:stop], self.std, add=self.add)
                    with self._progress:
                        self.filled = stop
                        self._progress.notify_all()
        except BaseException as error:  # re-raised by ready() in the training thread
            with self._progress:
                self.error = error
                self.filled = self.rows
                self._progress.notify_all()

    def ready(self, rows: int) -> int:
        """Block until the first ``rows`` rows hold their noise; how many do by now.

        The job's error, if any, is raised here.
        """
        filled = self.settle(rows)
        if self.error is not None:
            raise self.error
        return filled

    def settle(self, rows: int | None = None) -> int:
        """Block until the first ``rows`` rows (all by default) are done or the job failed.

        Returns the rows done by then (at least ``rows``).
        """
        limit = self.rows if rows is None else min(rows, self.rows)
        with self._progress:
            self._progress.wait_for(lambda: self.filled >= limit)
            return self.filled

    def wait(self) -> None:
        """Block until every row is done; raise the job's error here."""
        self.ready(self.rows)


class _Worker:
    """One long-lived daemon thread per process that runs the noise jobs in order.

    Cheaper than a thread per step: starting one costs ~0.1 ms, 1 % of a small model's step.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue[_Draw | _Fill | threading.Event] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="dpfy-noise", daemon=True).start()
        atexit.register(self.drain)

    def submit(self, job: _Draw | _Fill) -> None:
        """Queue a job; it runs after those queued before it (one stream order)."""
        self._jobs.put(job)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until the jobs queued so far have run (at exit: no kernel left mid-flight)."""
        if os.getpid() != self.pid:
            return
        done = threading.Event()
        self._jobs.put(done)
        done.wait(timeout)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, threading.Event):
                job.set()
            else:
                job.run()


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> _Worker:
    """This process's worker (a forked child starts its own: threads do not survive a fork)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.pid != os.getpid():
            _WORKER = _Worker()
        return _WORKER


class NoiseAhead:
    """A noise source that can draw a whole step's noise ahead of time, on a worker thread.

    ``prepare(params, std)`` starts drawing N(0, std²) buffers shaped like ``params``;
    ``take(params, std)`` returns them (drawn on the spot if nothing was prepared, or if the
    parameters changed shape, dtype or device since). ``prepare_head`` starts drawing the first
    rows of a parameter's fill early, which its :meth:`fill` or :meth:`add_later` puts in. It is
    also a plain :class:`NoiseSource` (``normal``), and its ``state_dict`` is the wrapped
    source's as of the last draw handed out.
    """

    def __init__(self, source: NoiseSource) -> None:
        self.source = source
        self._pending: _Draw | None = None
        self._later: list[_Fill] = []
        self._head: _Head | None = None  # drawn early, not yet put in

    def prepare(self, params: Mapping[str, Tensor], std: float) -> None:
        """Start drawing the next step's noise on a worker thread (no-op if one is waiting).

        Also a no-op while torch's threads use every core (:func:`draws_concurrently`):
        :meth:`take` then draws on the spot.
        """
        if self._pending is not None or not draws_concurrently():
            return
        self._pending = _Draw(self.source, _key(params, std))
        _worker().submit(self._pending)

    def take(self, params: Mapping[str, Tensor], std: float) -> dict[str, Tensor]:
        """This step's N(0, std²) buffers shaped like ``params``, each handed out once."""
        key = _key(params, std)
        self._drop_head()  # one not put in last step is never used
        draw, self._pending = self._pending, None
        if draw is not None:
            buffers = draw.result()
            if draw.key == key:
                return buffers
            # The model changed after prepare(): the draw is dropped, never used, and the
            # stream simply continues past it.
        buffers = _empty_buffers(key)  # drawn here, in the order the worker would draw them
        with torch.no_grad():
            _fill(self.source, buffers, key[1])
        return buffers

    def add_later(self, total: Tensor, std: float, name: str | None = None) -> None:
        """Add N(0, std²) into the finished sum ``total`` in place (on the worker if one is idle).

        For a parameter not drawn ahead whose sum began before this physical batch (virtual
        batching): the same blocks as :meth:`fill` draws (its head too, if ``name`` has one).
        :meth:`wait_later` blocks until done.
        """
        start = self._put_head(name, total, add=True)
        if not draws_concurrently():
            _draw_rows(self.source, total, std, add=True, start=start)
            return
        job = _Fill(self.source, total, std, add=True, start=start)
        if job.filled < job.rows:
            self._start(job)

    def fill(self, out: Tensor, std: float, name: str | None = None) -> Callable[[int], int] | None:
        """Fill ``out`` with N(0, std²) in blocks of rows (``row_blocks``), on the worker if idle.

        Returns ``ready(rows)``, which blocks until the first ``rows`` rows are filled and says
        how many are by then, so a product can be added into the rows already filled while the
        rest are drawn; or None when every row is filled already (drawn on this thread: no core
        was idle, or the tensor fits in the blocks this thread draws while the worker wakes), so
        the product need not be split into blocks. When ``name`` has a head, its rows are put in
        first and the worker draws from there on.
        """
        start = self._put_head(name, out, add=False)
        if not draws_concurrently():
            _draw_rows(self.source, out, std, add=False, start=start)
            return None
        job = _Fill(self.source, out, std, add=False, start=start)
        if job.filled >= job.rows:
            return None
        self._start(job, first_here=0 if start else FIRST_BLOCKS_HERE)
        if job.filled < job.rows:
            return job.ready
        job.wait()  # its error, if any, is raised here
        return None

    def prepare_head(
        self, name: str, like: Tensor, std: float, max_values: int | None = None
    ) -> None:
        """Start drawing the first ``HEAD_BLOCKS`` blocks of ``name``'s fill now, on the worker.

        For the parameter the clip phase fills first, called as the engine starts the product
        of the layer before it: meanwhile the worker draws those rows into a tensor of their
        own, so the fill's product can start on them at once. They are the numbers the fill
        would draw first, so nothing may be drawn between this and that fill. With
        ``max_values``, fewer blocks if they would hold more values (a memory bound). A no-op
        when no core is idle (the fill then draws them itself), the parameter has few blocks,
        or not even one block fits.
        """
        self._drop_head()
        blocks = _by_rows(like)[1]
        if not draws_concurrently() or len(blocks) <= HEAD_BLOCKS:
            return
        row_size = like[0].numel()
        count = HEAD_BLOCKS
        while count and max_values is not None and blocks[count - 1][1] * row_size > max_values:
            count -= 1
        if count == 0:
            return
        shape = (blocks[count - 1][1], *like.shape[1:])
        rows = torch.empty(shape, dtype=like.dtype, device=like.device)
        job = _Fill(self.source, rows, std, add=False, blocks=blocks[:count])
        _worker().submit(job)
        self._head = _Head(name, rows, job)

    def _put_head(self, name: str | None, out: Tensor, *, add: bool) -> int:
        """Copy (or add) the head into ``out``'s first rows if it is ``name``'s; the rows done.

        The head is used at most once: taken off here whether or not it fits ``out``.
        """
        head = self._head
        if head is None or name is None or head.name != name:
            return 0
        self._head = None
        head.job.wait()  # long done, as a rule; its error, if any, is raised here
        rows = _by_rows(out)[0]
        values = head.rows
        fits = values.shape[1:] == rows.shape[1:] and values.shape[0] <= rows.shape[0]
        if not fits or values.dtype != rows.dtype or values.device != rows.device:
            return 0  # not this tensor's (the model changed): dropped, never used
        with torch.no_grad():
            target = rows[: values.shape[0]]
            if add:
                target.add_(values)
            else:
                target.copy_(values)
        return values.shape[0]

    def _start(self, job: _Fill, first_here: int = 0) -> None:
        """Queue a fill or addition on the worker (see the module doc).

        With ``first_here``, a worker with nothing queued gets the job after this thread has
        drawn that many of its first blocks (:meth:`_Fill.hand_over_after`).
        """
        idle = self._pending is None and all(done.filled >= done.rows for done in self._later)
        self._later.append(job)
        if first_here and idle:
            job.hand_over_after(first_here, _worker().submit)
        else:
            _worker().submit(job)

    def wait_later(self) -> None:
        """Wait for every :meth:`fill` and :meth:`add_later`; raise the first error among them."""
        jobs, self._later = self._later, []
        for job in jobs:
            job.wait()

    def _settle_later(self) -> None:
        """Let every queued fill, addition and head finish (errors stay for whoever waits)."""
        for job in [*self._later, *([self._head.job] if self._head is not None else [])]:
            job.settle()

    def discard(self) -> None:
        """Drop a waiting draw and a head not put in: never used; the stream stays past them."""
        self._drop_head()
        draw, self._pending = self._pending, None
        if draw is not None:
            draw.wait()

    def _drop_head(self) -> None:
        """Forget a head not put in (it is never used), once its job is done."""
        head, self._head = self._head, None
        if head is not None:
            head.job.settle()

    def normal(self, like: Tensor, std: float) -> Tensor:
        """A plain draw from the wrapped source; a waiting draw is dropped first (never used)."""
        self.discard()
        return self.source.normal(like, std)

    def state_dict(self) -> Any:
        """The wrapped source's state as of the last noise handed out (see the module doc)."""
        self._settle_later()  # queued before any waiting draw: part of the stream so far
        if self._pending is not None:
            self._pending.wait()
            return self._pending.state_before
        return _state_of(self.source)

    def load_state_dict(self, state: Any) -> None:
        """Restore the stream; a draw made from the old state is dropped."""
        self._settle_later()
        self._later = []
        self.discard()
        load = getattr(self.source, "load_state_dict", None)
        if load is not None:
            load(state)


def draws_concurrently() -> bool:
    """Whether noise is drawn on the worker thread: torch computes on one thread of several.

    Read on the training thread (torch's thread count is per thread under OpenMP).
    """
    return torch.get_num_threads() == 1 and _cores() > 1


@functools.cache
def _cores() -> int:
    """The machine's CPU count, read once (``os.cpu_count`` reads /sys on every call)."""
    return os.cpu_count() or 1


def _key(params: Mapping[str, Tensor], std: float) -> _Key:
    """What a draw for these parameters and std must look like."""
    return tuple((name, p.shape, p.dtype, p.device) for name, p in params.items()), float(std)


def _empty_buffers(key: _Key) -> dict[str, Tensor]:
    """One uninitialised buffer per parameter in ``key``."""
    return {
        name: torch.empty(shape, dtype=dtype, device=device)
        for name, shape, dtype, device in key[0]
    }


def _fill(source: NoiseSource, buffers: dict[str, Tensor], std: float) -> None:
    """Overwrite every buffer with N(0, std²) from ``source``, in order (in place if it can)."""
    fill = getattr(source, "fill_", None)
    with torch.no_grad():
        for buffer in buffers.values():
            if fill is not None:
                fill(buffer, std)
            else:
                buffer.copy_(source.normal(buffer, std))


def _by_rows(out: Tensor) -> tuple[Tensor, Sequence[tuple[int, int]]]:
    """``out`` as rows (a scalar as one row of one) and its blocks of rows (``row_blocks``)."""
    rows = out.view(1, -1) if out.dim() == 0 else out
    return rows, row_blocks(rows.shape[0], rows[0].numel() if rows.shape[0] else 1)


def _draw_block(source: NoiseSource, block: Tensor, std: float, *, add: bool) -> None:
    """Fill one block of rows with N(0, std²), or add that noise into it."""
    if add:
        block.add_(source.normal(block, std))
    else:
        _fill(source, {"": block}, std)


def _draw_rows(source: NoiseSource, out: Tensor, std: float, *, add: bool, start: int = 0) -> None:
    """What a :class:`_Fill` does, all on this thread: the same blocks, in the same order.

    Blocks ending at or before row ``start`` hold their noise already (a head).
    """
    rows, blocks = _by_rows(out)
    with torch.no_grad():
        for first, stop in blocks:
            if stop > start:
                _draw_block(source, rows[first:stop], std, add=add)


def _state_of(source: NoiseSource) -> Any:
    """The source's saved state, or None for a source that keeps none."""
    save = getattr(source, "state_dict", None)
    return save() if save is not None else None


def _current_streams(tensors: Iterable[Tensor]) -> dict[torch.device, Any]:
    """The training thread's current CUDA stream on each device these tensors live on.

    The worker launches its kernels on the same streams, so on a GPU the training thread's later
    kernels (queued after it waited for the worker) run after the noise is in.
    """
    return {
        t.device: torch.cuda.current_stream(t.device) for t in tensors if t.device.type == "cuda"
    }


def _on_streams(streams: dict[torch.device, Any]) -> contextlib.AbstractContextManager[Any]:
    """Make these the worker thread's current streams (nothing to do on a CPU).

    The worker needs the interpreter lock for this while the training thread waits for it, so
    the CPU case costs nothing.
    """
    if not streams:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for stream in streams.values():
        stack.enter_context(torch.cuda.stream(stream))
    return stack
