"""The collate path, probed: on scheduled batches a few examples are also collated alone.

A ``collate_fn`` that standardises by the batch's statistics, or pads and normalises across the
batch, makes every example's row depend on the others (guide §5.5.1: only per-example
preprocessing keeps clipping meaningful). The probe compares an example's row of the batch with
the same fetched example collated alone — the very samples the batch was made from, so random
augmentation in the dataset raises no false alarm; a collate_fn that is random itself (it gives
an example alone two different rows under two random states) cannot be compared and is stated
as not checked. The verdict travels with the batch (:class:`Collated`), so it crosses worker
processes; the loader reads it in the main process.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from dpfy.data.batches import batch_length
from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.row_compare import first_difference, take_rows

#: Verdicts a probe gives a batch: passed, coupled (with the problem) or skipped (with why).
PASSED, COUPLED, SKIPPED = "passed", "coupled", "skipped"


class Collated(NamedTuple):
    """A collated batch and its probe's verdict (None: not probed), as workers hand it over."""

    batch: Any
    verdict: tuple[str, str] | None = None


class ProbingCollate:
    """Collate as the inner function does; on scheduled batches check each row stands alone.

    A class rather than a closure so that worker processes can pickle it. The schedule counts
    the batches this process collated (with workers: each worker's own batches).
    """

    def __init__(self, inner: Callable[[list[Any]], Any], schedule: CheckSchedule) -> None:
        self.inner = inner
        self.schedule = schedule
        self.calls = 0

    def __call__(self, samples: list[Any]) -> Collated:
        batch = self.inner(samples)
        due = self.schedule.due(self.calls)
        self.calls += 1
        return Collated(batch, probe_collate(self.inner, samples, batch) if due else None)


def probe_collate(
    collate: Callable[[list[Any]], Any], samples: list[Any], batch: Any
) -> tuple[str, str]:
    """Collate the last and a middle example alone; compare with their rows of ``batch``."""
    size = len(samples)
    if size < 2:
        return SKIPPED, "batches of fewer than two examples have nothing to couple"
    for row in sorted({size - 1, size // 2}):
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
