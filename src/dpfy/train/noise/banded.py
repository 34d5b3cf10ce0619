"""BandMF's noise, streamed (Choquette-Choo et al. 2023; McKenna 2024): O(b) state per parameter.

C is a b-banded lower-triangular Toeplitz matrix with c_0 = 1, so C w = z solves forward:

    w_t = z_t − Σ_{m=1}^{b−1} c_m w_{t−m},

and step t adds w_t: only the last b − 1 noise outputs of each parameter are kept. The strategy
is the plan's (optimised when the plan was made, :func:`dpfy.plan.correlated.optimise_banded`);
z_t is fresh from the run's noise source every step (:mod:`dpfy.train.noise.factorised`).
"""

from __future__ import annotations

import collections

import torch

from dpfy.plan.correlated.banded import BandedStrategy
from dpfy.train.noise.factorised import FactorisedMechanism
from dpfy.train.noise.mechanisms import register_mechanism

__all__ = ["BandedMechanism"]


class BandedMechanism(FactorisedMechanism):
    """w_t = z_t − Σ_{m<b} c_m w_{t−m} per parameter, keeping the last b − 1 outputs."""

    kind = "banded-mf"
    label = "BandMF"

    def _start(self, banded: BandedStrategy) -> None:  # type: ignore[override]
        """Empty buffers for the decoded strategy."""
        self._tail = tuple(float(c) for c in banded.coefficients[1:])  # c_1 … c_{b−1}
        self._history: dict[str, collections.deque[torch.Tensor]] = {
            name: collections.deque(maxlen=len(self._tail)) for name in self._like
        }  # most recent first

    @property
    def bands(self) -> int:
        """b: how many steps one draw of z reaches."""
        return len(self._tail) + 1

    def _correlate(self, name: str, fresh: torch.Tensor) -> torch.Tensor:
        history = self._history[name]
        for c, past in zip(self._tail, history, strict=False):
            if c != 0.0:
                fresh.add_(past, alpha=-c)
        if self._tail:
            history.appendleft(fresh)  # never written again: privatise only reads it
        return fresh

    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        return {name: list(history) for name, history in self._history.items()}

    def _check_counts(self, buffers: dict[str, list[torch.Tensor]], steps_done: int) -> None:
        expected = min(steps_done, len(self._tail))
        if any(len(tensors) != expected for tensors in buffers.values()):
            raise ValueError(
                f"a BandMF state after {steps_done} steps holds the last {expected} noise outputs "
                "of each parameter; this one does not"
            )

    def _restore(self, buffers: dict[str, list[torch.Tensor]]) -> None:
        self._history = {
            name: collections.deque(tensors, maxlen=len(self._tail))
            for name, tensors in buffers.items()
        }


register_mechanism("banded-mf")(BandedMechanism.from_plan)
