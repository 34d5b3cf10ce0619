"""When a run probes its own code for coupled examples: the first steps, then every n-th.

The probes cost an extra forward pass (and a few collates and loss gradients) on the steps they
run, so they run on the first steps, where a coupling shows at once, and then on a sparse
schedule that still sees batches late in the run (cost: ``benchmarks/behaviour_checks.py``,
figures in docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSchedule:
    """Probe batches ``0 … first-1``, then every ``every``-th batch (None: no more after that).

    ``CheckSchedule(first=0, every=None)`` turns the probes off; the report card then says no
    independence check ran.
    """

    first: int = 2
    every: int | None = 50

    def __post_init__(self) -> None:
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 0:
            raise ValueError(f"first must be a whole number ≥ 0, got {self.first!r}")
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ValueError(
                f"every must be a whole number ≥ 1 (probe every n-th batch) or None (only the "
                f"first batches), got {self.every!r}"
            )

    def due(self, batch: int) -> bool:
        """Whether the batch numbered ``batch`` (0-based, over the whole run) is probed."""
        return batch < self.first or (self.every is not None and batch % self.every == 0)

    @property
    def off(self) -> bool:
        """No batch is ever probed."""
        return self.first == 0 and self.every is None

    def __str__(self) -> str:
        if self.off:
            return "turned off"
        then = "" if self.every is None else f", then every {self.every}th"
        return f"first {self.first} batches{then}"
