"""The one private aggregation every variant releases through: clip → sum ÷ B → the noise.

DP-SGD's step (:class:`~dpfy.train.optim.DPOptimizer`: examples, microbatches or users clipped
by the engine), a DP-FedAvg round (:class:`~dpfy.federated.fedavg.DPFedAvg`) and a Flower round
(:class:`~dpfy.federated.flower.DPFedAvgStrategy`: whole user model changes clipped here) all
release ``(Σ_u clip_C(u) + noise) / B`` with this object (guide alg. 1 and alg. 2), so the
rules hold in one place:

- the sum is formed at 1/B with B the **expected** number of units (never the realised count,
  which depends on the data) and the noise is drawn at that scale, σ·sensitivity/B;
- every parameter's sum gets the mechanism's noise exactly once per step, opened from it before
  any unit is added (:meth:`open_sums`, or the engine's :meth:`opening`) or added by the
  mechanism afterwards (correlated noise: :meth:`release`);
- a unit clipped here is scaled to L2 norm ≤ C over all its tensors together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from dpfy._validate import check_positive
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.train.grads import NoiseStart
from dpfy.train.noise import banded, blt  # noqa: F401  (they register their mechanisms)
from dpfy.train.noise.mechanisms import GaussianMechanism, NoiseMechanism, make_mechanism
from dpfy.train.noise.source import NoiseSource

__all__ = ["PrivateAggregation", "clip_unit"]


def clip_unit(
    unit: Mapping[str, torch.Tensor], clip_norm: float
) -> tuple[dict[str, torch.Tensor], float]:
    """u · min(1, C/‖u‖) over all tensors together, and the unclipped norm ‖u‖ (guide alg. 2)."""
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in unit.values()))
    factor = clip_norm / max(norm, clip_norm)  # 1 when ‖u‖ ≤ C; never divides by zero
    return {name: t * factor for name, t in unit.items()}, norm


class PrivateAggregation:
    """A noise mechanism and the expected number of units B the step divides by.

    ``mechanism`` draws at the divisor's scale (its std is that of the noise on a sum ÷ B).
    """

    def __init__(self, mechanism: NoiseMechanism, divisor: float) -> None:
        self.mechanism = mechanism
        self.divisor = check_positive("expected units", divisor)

    @classmethod
    def from_plan(
        cls,
        plan: PrivacyPlan,
        params: Mapping[str, torch.Tensor],
        source: NoiseSource,
        share: Callable[[float], float] = float,
    ) -> PrivateAggregation:
        """The plan's mechanism over ``params`` at std ``share``(σ·sensitivity)/B.

        ``share`` is this process's part of the noise when ranks each add some (the
        distributed aggregator's ``share_std``); one process adds all of it.
        """
        std = share(plan.noise_std) / plan.divisor
        return cls(make_mechanism(plan, params, source, std), plan.divisor)

    @classmethod
    def gaussian(
        cls,
        names: frozenset[str],
        source: NoiseSource,
        noise_multiplier: float,
        clip_norm: float,
        divisor: float,
    ) -> PrivateAggregation:
        """Independent N(0, σ²C²) on the sum, ÷ B (DP-FedAvg rounds: one unit per user)."""
        std = check_positive("noise_multiplier", noise_multiplier) * check_positive(
            "clip_norm", clip_norm
        )
        divisor = check_positive("expected units", divisor)
        return cls(GaussianMechanism(names, source, std / divisor), divisor)

    @property
    def scale(self) -> float:
        """What each clipped unit is multiplied by as it is summed: 1/B."""
        return 1.0 / self.divisor

    def opening(self) -> NoiseStart | None:
        """The noise the engine opens each parameter's sum from (None: added at release)."""
        return self.mechanism.opening()

    def open_sums(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sums formed outside the engine, shaped like ``like``, opened from their noise."""
        sums = {name: torch.zeros_like(t) for name, t in like.items()}
        opening = self.mechanism.opening()
        if opening is not None:
            for name, out in sums.items():
                opening.fill(name, out)
        return sums

    def add_clipped(
        self, sums: Mapping[str, torch.Tensor], unit: Mapping[str, torch.Tensor], clip_norm: float
    ) -> float:
        """Clip one whole unit to C and add it at 1/B into ``sums``; returns its unclipped norm."""
        clipped, norm = clip_unit(unit, clip_norm)
        for name, value in clipped.items():
            sums[name].add_(value, alpha=self.scale)
        return norm

    def release(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The privatised average: the sums with the mechanism's noise (once the step may run)."""
        return self.mechanism.privatise(sums)
