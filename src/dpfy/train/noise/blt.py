"""BLT's noise, streamed (Dvijotham, McMahan et al. 2024): O(d) state per parameter.

A buffered linear Toeplitz C has an inverse that is again a BLT, with decays θ̂_j and weights
ω̂_j (:meth:`dpfy.plan.correlated.Blt.inverse`), so (C⁻¹ z)_t needs d running sums per parameter:

    w_t = z_t + Σ_j ω̂_j s_{j,t},      s_{j,t+1} = θ̂_j s_{j,t} + z_t,      s_{j,0} = 0.

The strategy is the plan's (optimised when the plan was made, :func:`dpfy.plan.correlated.
optimise_blt`); z_t is fresh from the run's noise source every step
(:mod:`dpfy.train.noise.factorised`).
"""

from __future__ import annotations

import torch

from dpfy.plan.correlated.blt import Blt
from dpfy.train.noise.factorised import FactorisedMechanism
from dpfy.train.noise.mechanisms import register_mechanism

__all__ = ["BltMechanism"]


class BltMechanism(FactorisedMechanism):
    """w_t = z_t + Σ_j ω̂_j s_j, then s_j ← θ̂_j s_j + z_t, per parameter (d buffers)."""

    kind = "blt"
    label = "BLT"

    def _start(self, blt: Blt) -> None:  # type: ignore[override]
        """Empty buffers for the decoded strategy."""
        inverse = blt.inverse()
        self._decays = tuple(float(theta) for theta in inverse.decays)
        self._weights = tuple(float(omega) for omega in inverse.weights)
        self._sums: dict[str, list[torch.Tensor]] = {}  # made at the first step

    @property
    def buffers(self) -> int:
        """d: running sums kept per parameter (the inverse's; equal decays are merged)."""
        return len(self._decays)

    def _correlate(self, name: str, fresh: torch.Tensor) -> torch.Tensor:
        sums = self._sums.get(name)
        if sums is None:
            sums = self._sums[name] = [torch.zeros_like(fresh) for _ in self._decays]
        out = fresh.clone()
        for weight, running in zip(self._weights, sums, strict=True):
            out.add_(running, alpha=weight)
        for theta, running in zip(self._decays, sums, strict=True):
            running.mul_(theta).add_(fresh)
        return out

    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        return {name: list(self._sums.get(name, ())) for name in self._like}

    def _check_counts(self, buffers: dict[str, list[torch.Tensor]], steps_done: int) -> None:
        expected = {self.buffers} if steps_done else {0, self.buffers}
        if any(len(tensors) not in expected for tensors in buffers.values()):
            raise ValueError(
                f"a BLT state holds {self.buffers} running sums per parameter; this one does not"
            )

    def _restore(self, buffers: dict[str, list[torch.Tensor]]) -> None:
        self._sums = {name: tensors for name, tensors in buffers.items() if tensors}


register_mechanism("blt")(BltMechanism.from_plan)
