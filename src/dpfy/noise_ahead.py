"""Drawing the next step's noise on a worker thread while the model computes.

On a CPU, drawing N(0, σ²C²) for every coordinate is not free: torch's Mersenne Twister and
Box–Muller cost about 3 ns per coordinate, which for a small model (a 670 000-parameter MLP at
batch size 256) is a fifth of a non-private step. The noise does not depend on the data, so it
can be drawn *before* the gradients exist: :class:`NoiseAhead` starts the draw for the next
logical batch on a worker thread when the optimizer's ``zero_grad()`` opens it, and the forward
and backward passes run meanwhile (torch releases the interpreter lock inside its kernels). The
private optimizer then takes the finished buffers and has the engine add the clipped sum *into*
them, so the step holds no second parameter-sized buffer.

What this must not break:

- every draw is used at most once — a draw that is not taken (a refused or failed step, a model
  moved to another device) is dropped, never handed out again;
- a checkpoint saved while a draw is waiting stores the generator state from *before* that
  draw, so a resumed run draws exactly what an uninterrupted one would have;
- nothing about the draw depends on data: shapes, dtypes, devices and the std only.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dpfy.noise import NoiseSource

__all__ = ["NoiseAhead"]

#: Coordinates per draw when noise is added to a finished sum: the worker then holds one buffer
#: of at most this size (1 MiB in float32), not one as large as the parameter.
ADD_CHUNK = 1 << 18

#: What a draw is for: each parameter's name, shape, dtype and device, and the std.
_Key = tuple[tuple[tuple[str, torch.Size, torch.dtype, torch.device], ...], float]


class _Draw:
    """One draw of noise buffers, run by the worker thread; the source's state before it."""

    def __init__(self, source: NoiseSource, key: _Key) -> None:
        self.source, self.key = source, key
        self.state_before: Any = None
        # Allocated by the training thread: memory then comes from (and returns to) its own
        # allocator arena, which the rest of the step reuses; a worker's arena would be grown
        # and trimmed back every step, and pages faulted in again.
        self.buffers = _empty_buffers(key)
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        """Note the source's state, fill every buffer; keep an error for the thread that waits."""
        try:
            self.state_before = _state_of(self.source)
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


class _AddNoise:
    """Adds N(0, std²) into a finished sum, in place, in chunks (run by the worker thread)."""

    def __init__(self, source: NoiseSource, total: Tensor, std: float) -> None:
        self.source, self.total, self.std = source, total, std
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        """Add a fresh draw to every coordinate; keep an error for the thread that waits."""
        try:
            with torch.no_grad():
                flat = self.total.view(-1)
                for start in range(0, flat.numel(), ADD_CHUNK):
                    chunk = flat[start : start + ADD_CHUNK]
                    chunk.add_(self.source.normal(chunk, self.std))
        except BaseException as error:
            self.error = error
        finally:
            self.total = None  # type: ignore[assignment]
            self._done.set()

    def wait(self) -> None:
        """Block until done; raise its error here."""
        self._done.wait()
        if self.error is not None:
            raise self.error


class _Worker:
    """One long-lived daemon thread per process running draws in order (cheaper than a thread
    per step: starting one costs ~0.1 ms, a tenth of a percent of a step or more)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue[_Draw | _AddNoise] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="dpfy-noise", daemon=True).start()

    def submit(self, job: _Draw | _AddNoise) -> None:
        """Queue a job; it runs after those queued before it (one stream order)."""
        self._jobs.put(job)

    def _serve(self) -> None:
        while True:
            self._jobs.get().run()


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
    parameters changed shape, dtype or device since). It is also a plain :class:`NoiseSource`
    (``normal``), and its ``state_dict`` is the wrapped source's as of the last draw handed out.
    """

    def __init__(self, source: NoiseSource) -> None:
        self.source = source
        self._pending: _Draw | None = None
        self._later: list[_AddNoise] = []

    def prepare(self, params: Mapping[str, Tensor], std: float) -> None:
        """Start drawing the next step's noise on a worker thread (no-op if one is waiting)."""
        if self._pending is not None:
            return
        self._pending = _Draw(self.source, _key(params, std))
        _worker().submit(self._pending)

    def take(self, params: Mapping[str, Tensor], std: float) -> dict[str, Tensor]:
        """This step's N(0, std²) buffers shaped like ``params``, each handed out once."""
        key = _key(params, std)
        draw, self._pending = self._pending, None
        if draw is not None:
            buffers = draw.result()
            if draw.key == key:
                return buffers
            # The model changed after prepare(): the draw is dropped, never used, and the
            # stream simply continues past it.
        buffers = _empty_buffers(key)
        _fill(self.source, buffers, key[1])
        return buffers

    def add_later(self, total: Tensor, std: float) -> None:
        """Add N(0, std²) into ``total`` in place on the worker, after the draws queued before.

        For parameters whose noise is not drawn ahead (memory): their sum is final before the
        rest of the step is, and the worker adds their noise meanwhile. :meth:`wait_later` blocks
        until every such addition is done.
        """
        job = _AddNoise(self.source, total, std)
        self._later.append(job)
        _worker().submit(job)

    def wait_later(self) -> None:
        """Wait for every :meth:`add_later`; raise the first error among them."""
        jobs, self._later = self._later, []
        for job in jobs:
            job.wait()

    def _settle_later(self) -> None:
        """Let every queued addition finish (errors stay for :meth:`wait_later`)."""
        for job in self._later:
            job._done.wait()

    def discard(self) -> None:
        """Drop a waiting draw: its noise is never used; the stream stays past it."""
        draw, self._pending = self._pending, None
        if draw is not None:
            draw.wait()

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


def _state_of(source: NoiseSource) -> Any:
    """The source's saved state, or None for a source that keeps none."""
    save = getattr(source, "state_dict", None)
    return save() if save is not None else None
