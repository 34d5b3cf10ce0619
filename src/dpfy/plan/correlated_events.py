"""What a matrix-factorisation training run (BandMF, BLT) costs, step by step and in total.

Setting (:mod:`dpfy.plan.correlated`, docs/correlated-noise.md): the batches come in one order
fixed before training, independently of the data, and repeated every epoch, so over T steps of
s = N // B per epoch an example takes part in at most k = ⌈T/s⌉ steps, exactly s apart:
``MinSeparation(k, s)``. The run releases C x + σ z (step t adds σ · sensitivity · (C⁻¹ z)_t
to its clipped sum), which is ONE Gaussian mechanism of noise multiplier σ/Δ_T(k) (Denisov et al.
2022 for adaptivity, Choquette-Choo et al. 2022 for several participations) under zero-out
adjacency; Δ_T(j) is the sensitivity of the T×T strategy when an example takes part at most j
times (:func:`~dpfy.plan.correlated.sensitivity.toeplitz_sensitivity_squared`).

The ledger is charged step by step without changing that total. Gaussian mechanisms compose
exactly in μ² = (Δ/σ)²: a Gaussian of noise σ/Δ is the composition of Gaussians of noise
σ/√d_j whenever Σ_j d_j = Δ². So the first step of epoch j (1-based) is charged
``GaussianEvent(σ / √(Δ_T(j)² − Δ_T(j−1)²))`` and every other step nothing (``NoOpEvent``).
After epoch j's first step the ledger holds the Gaussian of noise σ/Δ_T(j): the whole T-step
mechanism when examples take part at most j times, which bounds the rows released so far (fewer
rows only shrink the sensitivity) and every example's participations up to then. After the run
it is exactly :func:`~dpfy.plan.correlated.accounting.correlated_accounting`'s event.

Amplified BandMF (sampler ``cyclic-poisson``, :class:`CyclicCharges`): the examples are split
once, independently of the data, into b groups (b = the bands), and step t Poisson-samples group
t mod b at rate q̃ = b·B/N. By the amplification theorem of Choquette-Choo et al. 2023 the run is
⌈T/b⌉ composed Poisson-subsampled Gaussians of noise σ/‖largest column of C‖ under add-or-remove
adjacency (:func:`~dpfy.plan.correlated.accounting.amplified_banded_event`); group 0 takes part in
the most rounds, so every step t ≡ 0 (mod b) is charged one such round and the others nothing.

The plan stores the strategy as a tuple of floats (:func:`encode_strategy`): BandMF's
coefficients (1, c_1, …, c_{b−1}); a BLT's decays then weights (θ_1..θ_d, ω_1..ω_d).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    GaussianEvent,
    NoOpEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)
from dpfy.plan.correlated.banded import BandedStrategy
from dpfy.plan.correlated.blt import Blt
from dpfy.plan.correlated.participation import CyclicPoisson, MinSeparation
from dpfy.plan.correlated.sensitivity import (
    Sensitivity,
    column_norm_squared,
    toeplitz_sensitivity_squared,
)

#: The plan's mechanism name of each matrix-factorisation strategy, and the algorithm using it.
CORRELATED_MECHANISMS = {"banded-mf": "bandmf", "blt": "blt"}

Strategy = BandedStrategy | Blt


def encode_strategy(strategy: Strategy) -> tuple[float, ...]:
    """The plan's tuple: BandMF's coefficients, or a BLT's decays followed by its weights."""
    if isinstance(strategy, BandedStrategy):
        return tuple(strategy.coefficients)
    if isinstance(strategy, Blt):
        return (*strategy.decays, *strategy.weights)
    raise ValueError(f"not a matrix-factorisation strategy: {type(strategy).__name__}")


def decode_strategy(mechanism: str, values: tuple[float, ...] | None) -> Strategy:
    """The strategy a plan names by ``mechanism`` ('banded-mf' or 'blt') and its tuple.

    Refuses a tuple that does not describe one (validated by the strategy classes), and a BLT
    whose inverse is not a stable BLT (its noise could not be streamed).
    """
    if values is None:
        raise ValueError(f"the {mechanism} mechanism needs its strategy's coefficients")
    values = tuple(float(v) for v in values)
    if mechanism == "banded-mf":
        return BandedStrategy(values)
    if mechanism == "blt":
        if len(values) % 2:
            raise ValueError(
                f"a BLT strategy holds its decays then its weights (an even count), got "
                f"{len(values)} numbers"
            )
        half = len(values) // 2
        strategy = Blt(values[:half], values[half:])
        strategy.inverse()  # refuses complex or unstable inverse decays
        return strategy
    known = ", ".join(CORRELATED_MECHANISMS)
    raise ValueError(f"mechanism must be one of {known} to hold a strategy; got {mechanism!r}")


def describe_strategy(mechanism: str, values: tuple[float, ...] | None) -> str:
    """A short phrase for reports and banners: 'BandMF, 16 bands' or 'BLT, 4 buffers'."""
    strategy = decode_strategy(mechanism, values)
    if isinstance(strategy, BandedStrategy):
        return f"BandMF, {strategy.bands} band{'s' if strategy.bands != 1 else ''}"
    return f"BLT, {strategy.buffers} buffer{'s' if strategy.buffers != 1 else ''}"


def epoch_participation(steps: int, steps_per_epoch: int) -> MinSeparation:
    """``MinSeparation(⌈T/s⌉, s)``: once per epoch, exactly ``steps_per_epoch`` apart."""
    steps = check_count("steps", steps, minimum=1)
    per_epoch = check_count("steps_per_epoch", steps_per_epoch, minimum=1)
    return MinSeparation.epochs(-(-steps // per_epoch), per_epoch)


@dataclass(frozen=True)
class EpochCharges:
    """Δ_T(j)² for j = 1..k, and what each epoch's first step is charged at any σ."""

    steps: int
    steps_per_epoch: int
    sensitivities: tuple[Sensitivity, ...]

    @property
    def increments(self) -> tuple[float, ...]:
        """d_j = Δ_T(j)² − Δ_T(j−1)² (never negative: a bound that fell is not refunded)."""
        out, reached = [], 0.0
        for sensitivity in self.sensitivities:
            out.append(max(0.0, sensitivity.squared - reached))
            reached = max(reached, sensitivity.squared)
        return tuple(out)

    @property
    def total(self) -> Sensitivity:
        """Δ_T(k): the sensitivity of the whole run."""
        return self.sensitivities[-1]

    @property
    def period(self) -> int:
        """Steps between an example's chances to take part: an epoch."""
        return self.steps_per_epoch

    def step_event(self, step: int, noise_multiplier: float) -> DpEvent:
        """What step ``step`` (0-based) is charged: epoch j's increment at its first step."""
        step = check_count("step", step)
        if step >= self.steps:
            raise ValueError(f"step {step} is beyond the {self.steps} steps accounted")
        if step % self.steps_per_epoch:
            return NoOpEvent()
        return _increment_event(self.increments[step // self.steps_per_epoch], noise_multiplier)

    def run_events(self, noise_multiplier: float) -> DpEvent:
        """Exactly what the ledger composes over the whole run (its NoOps left out)."""
        events = tuple(_increment_event(d, noise_multiplier) for d in self.increments)
        return ComposedEvent(tuple(e for e in events if not isinstance(e, NoOpEvent)))


def epoch_charges(strategy: Strategy, steps: int, steps_per_epoch: int) -> EpochCharges:
    """Δ_T(j) of ``strategy`` over ``steps`` steps for j = 1..⌈T/s⌉ participations."""
    participation = epoch_participation(steps, steps_per_epoch)
    coefficients = strategy.toeplitz(steps)
    sensitivities = tuple(
        toeplitz_sensitivity_squared(
            coefficients, steps, MinSeparation(j, participation.separation)
        )
        for j in range(1, participation.max_participations + 1)
    )
    return EpochCharges(steps, participation.separation, sensitivities)


@dataclass(frozen=True)
class CyclicCharges:
    """Amplified BandMF's charges: one Poisson-sampled Gaussian round every ``groups`` steps."""

    steps: int
    groups: int
    sampling_rate: float
    column: Sensitivity  # the largest column norm of C: each round's sensitivity

    @property
    def period(self) -> int:
        """Steps between an example's chances to take part: one cycle of the groups."""
        return self.groups

    @property
    def rounds(self) -> int:
        """⌈T/b⌉: the rounds of group 0, the busiest."""
        return -(-self.steps // self.groups)

    def _round(self, noise_multiplier: float) -> DpEvent:
        sigma = check_positive("noise_multiplier", noise_multiplier)
        return PoissonSampledEvent(self.sampling_rate, GaussianEvent(sigma / self.column.norm))

    def step_event(self, step: int, noise_multiplier: float) -> DpEvent:
        """What step ``step`` (0-based) is charged: a round of group 0 at t ≡ 0 (mod b)."""
        step = check_count("step", step)
        if step >= self.steps:
            raise ValueError(f"step {step} is beyond the {self.steps} steps accounted")
        return NoOpEvent() if step % self.groups else self._round(noise_multiplier)

    def run_events(self, noise_multiplier: float) -> DpEvent:
        """Exactly what the ledger composes over the whole run: ⌈T/b⌉ rounds."""
        return SelfComposedEvent(self._round(noise_multiplier), self.rounds)


def cyclic_charges(
    strategy: BandedStrategy, steps: int, groups: int, sampling_rate: float
) -> CyclicCharges:
    """Amplified BandMF's charges; refuses more bands than groups (no amplification then)."""
    steps = check_count("steps", steps, minimum=1)
    participation = CyclicPoisson(check_count("groups", groups, minimum=1), sampling_rate)
    if strategy.bands > participation.groups:
        raise ValueError(
            f"amplified BandMF needs bands <= groups, got {strategy.bands} bands and "
            f"{participation.groups} groups"
        )
    squared = column_norm_squared(strategy.toeplitz(steps), steps)
    column = Sensitivity(squared, True, "amplified rounds: the largest column norm")
    return CyclicCharges(steps, participation.groups, float(sampling_rate), column)


Charges = EpochCharges | CyclicCharges


def run_charges(
    mechanism: str,
    strategy: tuple[float, ...] | None,
    sampler: str,
    steps: int,
    records: int,
    batch_size: int,
) -> Charges:
    """What each step of a planned run is charged, from the plan's fields.

    ``sampler`` 'fixed-order-epochs' (epochs of N // B steps) or 'cyclic-poisson' (BandMF only:
    as many groups as bands, rate b·B/N).
    """
    decoded = decode_strategy(mechanism, strategy)
    if sampler == "cyclic-poisson":
        if not isinstance(decoded, BandedStrategy):
            raise ValueError("cyclic Poisson sampling amplifies BandMF only, not a BLT")
        groups = decoded.bands
        return cyclic_charges(decoded, steps, groups, groups * batch_size / records)
    return epoch_charges(decoded, steps, records // batch_size)


def _increment_event(increment: float, noise_multiplier: float) -> DpEvent:
    """The Gaussian of μ² = d/σ² (noise multiplier σ/√d), or nothing for d = 0."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    if increment <= 0.0:
        return NoOpEvent()
    return GaussianEvent(sigma / math.sqrt(increment))


__all__ = [
    "CORRELATED_MECHANISMS",
    "Charges",
    "CyclicCharges",
    "EpochCharges",
    "cyclic_charges",
    "decode_strategy",
    "describe_strategy",
    "encode_strategy",
    "epoch_charges",
    "epoch_participation",
    "run_charges",
]
