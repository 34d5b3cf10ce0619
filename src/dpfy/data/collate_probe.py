"""The collate path, probed: on scheduled batches a few examples are also collated alone.

A ``collate_fn`` that standardises by the batch's statistics, or pads and normalises across the
batch, makes every example's row depend on the others (guide §5.5.1: only per-example
preprocessing keeps clipping meaningful). The probe compares an example's row of the batch with
the same fetched example collated alone — the very samples the batch was made from, so random
augmentation in the dataset raises no false alarm; a collate_fn that is random itself (it gives
an example alone two different rows under two random states) cannot be compared and is stated
as not checked. The verdict travels with the batch (:class:`Collated`), so it crosses worker
processes; the loader reads it in the main process. A static-shape batch's padding rows (copies
of one dataset row) are never the rows probed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from dpfy.data.batches import batch_length
from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.padding import Padding
from dpfy.data.row_compare import first_difference, take_rows

#: Verdicts a probe gives a batch: passed, coupled (with the problem) or skipped (with why).
PASSED, COUPLED, SKIPPED = "passed", "coupled", "skipped"


class Collated(NamedTuple):
    """A collated batch and its probe's verdict (None: not probed), as workers hand it over."""

    batch: Any
    verdict: tuple[str, str] | None = None


#: Why a padded batch collated in a worker process is not probed.
IN_WORKER = (
    "the batch was collated in a worker process, which cannot tell a padded batch's examples "
    "from its padding rows (the sampler draws in the main process; num_workers=0 checks it)"
)


class ProbingCollate:
    """Collate as the inner function does; on scheduled batches check each row stands alone.

    A class rather than a closure so that worker processes can pickle it. The schedule counts
    the batches this process collated (with workers: each worker's own batches). ``padding``
    gives the padding marks of the batch being collated (None: not padded), read where the
    sampler draws: in the main process (:class:`LastDrawn`); the probe then follows examples
    only, never padding rows.
    """

    def __init__(
        self,
        inner: Callable[[list[Any]], Any],
        schedule: CheckSchedule,
        padding: Callable[[], Padding | None] | None = None,
    ) -> None:
        self.inner = inner
        self.schedule = schedule
        self.padding = padding
        self.calls = 0

    def __call__(self, samples: list[Any]) -> Collated:
        batch = self.inner(samples)
        due = self.schedule.due(self.calls)
        self.calls += 1
        return Collated(batch, self._probe(samples, batch) if due else None)

    def _probe(self, samples: list[Any], batch: Any) -> tuple[str, str]:
        """The probe's verdict on ``batch``, its rows drawn among the batch's examples."""
        padding = None if self.padding is None else self.padding()
        if padding is not None and get_worker_info() is not None:
            return SKIPPED, IN_WORKER  # a worker's sampler copy does not draw: its marks are stale
        examples = None if padding is None else padding.real
        return probe_collate(self.inner, samples, batch, examples)

    def __getstate__(self) -> dict[str, Any]:
        """For a worker process: whether batches are padded, not the sampler (it stays here)."""
        state = dict(self.__dict__)
        if self.padding is not None:
            state["padding"] = _padded if self.padding() is not None else None
        return state


class LastDrawn:
    """The padding marks of the batch ``sampler`` drew last: in the main process, the batch
    being collated (the DataLoader collates each batch as soon as it is drawn)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler  # a DpBatchSampler: ``position`` and ``padding(position)``

    def __call__(self) -> Padding | None:
        return self.sampler.padding(self.sampler.position)


def _padded() -> Padding | None:
    """A worker's stand-in for the sampler of padded batches: padded, rows unknown there."""
    return Padding(1, 0)


def probe_collate(
    collate: Callable[[list[Any]], Any],
    samples: list[Any],
    batch: Any,
    examples: int | None = None,
) -> tuple[str, str]:
    """Collate the last and a middle example alone; compare with their rows of ``batch``.

    ``examples``: how many of the first rows are examples (the rest: padding, never probed).
    """
    size = len(samples)
    real = size if examples is None else min(examples, size)
    if real < 2:
        return SKIPPED, "batches of fewer than two examples have nothing to couple"
    for row in sorted({real - 1, real // 2}):
        alone = _collate_twice(collate, samples[row])
        if alone is None:
            return SKIPPED, "the collate_fn is random (an example alone collates differently)"
        try:
            if batch_length(alone) != 1:
                return SKIPPED, "the collate_fn does not return one row per example"
        except ValueError:
            return SKIPPED, "the collated batch has no batch dimension to compare"
        mine = take_rows(batch, size, torch.tensor([row]))
        problem = first_difference(mine, alone, crop=True)
        if problem is not None:
            return COUPLED, (
                f"the collate_fn: example {row}'s row of the batch is not what it collates to "
                f"alone ({problem}), so each example's input depends on the others (batch "
                "statistics in collate_fn?). Fix: preprocess each example on its own — scale by "
                "public constants, or fit statistics on public data — and keep the examples in "
                "the order they were fetched"
            )
    return PASSED, ""


def _collate_twice(collate: Callable[[list[Any]], Any], sample: Any) -> Any:
    """``collate([sample])`` under two random states; None if they differ (a random collate).

    The caller's random streams (torch, ``random``, numpy) are left as they were.
    """
    cpu = torch.default_generator  # the CPU stream only: torch.manual_seed also walks devices
    saved = cpu.get_state(), random.getstate(), np.random.get_state()
    try:
        results = []
        for seed in (0x5EED, 0xD1CE):
            cpu.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
            results.append(collate([sample]))
    finally:
        cpu.set_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])
    return results[0] if first_difference(results[0], results[1]) is None else None
