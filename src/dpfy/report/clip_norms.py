"""Gradient norms before clipping, kept during training and summarised against C (guide §5.4.1).

The engine computes these norms to clip; :func:`record_clip_norms` only keeps them. They are
statistics of private data: the report shows them as diagnostics, never as part of the claim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpfy._validate import check_positive

if TYPE_CHECKING:
    from dpfy.train.session import PrivateTraining


@dataclass(frozen=True)
class GradNormStats:
    """Per-example gradient norms before clipping, summarised (guide §5.4.1: C vs the norms)."""

    count: int
    max_grad_norm: float
    median: float
    p10: float
    p25: float
    p75: float
    p90: float
    maximum: float
    mean: float
    fraction_clipped: float

    @classmethod
    def from_norms(cls, norms: Iterable[float] | np.ndarray, max_grad_norm: float) -> GradNormStats:
        """Summarise unclipped per-unit norms collected during training against the clip norm C."""
        source = norms if isinstance(norms, np.ndarray) else list(norms)
        values = np.asarray(source, dtype=float).ravel()
        if values.size == 0:
            raise ValueError("no gradient norms were collected; run at least one non-empty step")
        clip = check_positive("max_grad_norm", max_grad_norm)
        p10, p25, p50, p75, p90 = np.quantile(values, [0.1, 0.25, 0.5, 0.75, 0.9])
        return cls(
            count=int(values.size),
            max_grad_norm=clip,
            median=float(p50),
            p10=float(p10),
            p25=float(p25),
            p75=float(p75),
            p90=float(p90),
            maximum=float(values.max()),
            mean=float(values.mean()),
            fraction_clipped=float(np.mean(values > clip)),
        )


class NormLog:
    """Unclipped per-unit gradient norms seen during training, for :class:`GradNormStats`."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []

    def add(self, norms: Any) -> None:
        """Keep one step's norms (a tensor or array)."""
        if hasattr(norms, "detach"):
            norms = norms.detach().cpu().numpy()
        self._chunks.append(np.asarray(norms, dtype=np.float64).ravel())

    @property
    def norms(self) -> np.ndarray:
        """All norms kept so far."""
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0)

    def stats(self, max_grad_norm: float) -> GradNormStats:
        """The summary the report prints."""
        return GradNormStats.from_norms(self.norms, max_grad_norm)


@contextlib.contextmanager
def record_clip_norms(training: PrivateTraining) -> Iterator[NormLog]:
    """Log the unclipped norms of every clipping the run's optimizer does inside the block.

    The engine computes these norms to clip; this only keeps them (they are statistics of private
    data, used for the report's clip-norm check and never fed back into training).
    """
    log = NormLog()
    observers = training.optimizer.clip_observers

    def observe(result: Any) -> None:
        log.add(result.norms)

    observers.append(observe)
    try:
        yield log
    finally:
        observers.remove(observe)


__all__ = ["GradNormStats", "NormLog", "record_clip_norms"]
