"""Quick privacy *approximations*: textbook composition bounds and the guide's scaling law.

Everything here is an approximation for planning and for brackets, never the number to report:
every function's name or result says so, every result carries ``is_approximation = True`` and a
``label``, and its ``str()`` starts with "approximation". Report ε from an accountant
(``dpfy.plan.accounting``, PLD or RDP), as the guide insists (§4.2.2, §5.3.2).

* :func:`basic_composition` and :func:`advanced_composition` are the classical (ε, δ) composition
  theorems: valid upper bounds, but loose, since they ignore what the mechanisms are.
* :func:`scaling_law_epsilon` is the guide's rule of thumb for DP-SGD (§4.2.2, App. B),
  ``ε ≈ A·q·√k/σ + B·k·q²/σ²`` for Poisson rate q, k steps and noise multiplier σ, with A and B
  fitted to a real accountant by ``benchmarks/fit_scaling_law.py``;
  :func:`scaling_law_noise_multiplier` inverts it. Use them for intuition and for initial
  brackets of an exact calibration.

Fitted constants (``SCALING_LAW_FITS``), from ``benchmarks/fit_scaling_law.py`` against Google's
``dp_accounting`` 0.6.0 (its PLD accountant, discretisation refined until ε moved < 0.2%, and its
RDP accountant with default orders), add-or-remove adjacency, Poisson sampling. (A, B) ≥ 0 were
chosen per δ to minimise the maximum relative error over a 9×9×9 log-spaced grid of the region

    q in [1e-4, 0.05], σ in [1.5, 5], k in [100, 1e5], q·k ≥ 1 (an epoch or more), ε in [1, 20].

======  ======  =======  =======  ==========================================================
 fit     δ        A        B      relative error: grid median / max; validation median / max
======  ======  =======  =======  ==========================================================
 PLD    1e-5    4.0948   0.7560   6.4% / 13.3%
 PLD    1e-6    4.7526   0.7457   7.8% / 14.2%
 PLD    1e-7    5.3300   0.7962   9.2% / 15.2%;  validation 7.9% / 14.3% (89 random points)
 RDP    1e-5    4.5446   0.7835   8.0% / 14.7%
 RDP    1e-6    5.3937   0.1444   7.1% / 17.3%
 RDP    1e-7    6.0452   0.0000   7.9% / 19.9%;  validation 7.1% / 17.1% (94 random points)
======  ======  =======  =======  ==========================================================

Validation points are random in the region at random δ in [1e-7, 1e-5], with A and B
*interpolated linearly in log δ* between the fitted δ; that is also how other δ are handled.
Outside [1e-7, 1e-5] the same lines are *extrapolated* (clipped at 0): at δ = 1e-8 the max error
was 18% (PLD) and 22% (RDP), at δ = 1e-4 14% (PLD) but 47% (RDP). Stated bounds, used by
``ScalingLawEstimate.bracket``: max relative error 16% (PLD), 20% (RDP) inside the region.

Outside the region the law degrades quickly (measured on random points): with σ in [1, 1.5) max
errors of 31% (PLD) and 38% (RDP); with σ in [0.5, 1) 89% and 93%, i.e. off by up to ten times —
for small σ the loss grows like exp(1/σ²), not 1/σ. Estimates outside the region are still
returned, with ``notes`` saying which input is outside.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from dpfy._validate import (
    check_count,
    check_delta,
    check_positive,
    check_range,
    check_sampling_rate,
)

__all__ = [
    "SCALING_LAW_FITS",
    "CompositionApproximation",
    "ScalingLawEstimate",
    "ScalingLawFit",
    "advanced_composition",
    "basic_composition",
    "scaling_law_epsilon",
    "scaling_law_noise_multiplier",
]

_REPORT_HINT = "use an accountant (dpfy.plan.accounting) for the ε you report"


# -- classical composition ---------------------------------------------------------------------


@dataclass(frozen=True)
class CompositionApproximation:
    """An (ε, δ) from a generic composition theorem: a loose bound, labelled an approximation.

    Unpacks like the tuple ``(epsilon, delta)``.
    """

    epsilon: float
    delta: float
    method: str
    is_approximation: bool = field(default=True, init=False)

    @property
    def label(self) -> str:
        """What produced the numbers, in words a report can quote."""
        return f"approximation ({self.method}); {_REPORT_HINT}"

    def __iter__(self) -> Iterator[float]:
        """Allow ``epsilon, delta = basic_composition(...)``."""
        yield self.epsilon
        yield self.delta

    def __str__(self) -> str:
        numbers = f"(ε={self.epsilon:.4g}, δ={self.delta:.3g})"
        return f"approximation: {numbers} by {self.method}; {_REPORT_HINT}"


def _check_composition_inputs(epsilon: float, delta: float, k: int) -> tuple[float, float, int]:
    """ε > 0, δ in [0, 1) (δ = 0 is pure DP) and a whole number of runs k ≥ 1."""
    epsilon = check_positive("epsilon", epsilon)
    delta = check_range("delta", delta, 0.0, 1.0, low_open=False)
    return epsilon, delta, check_count("k", k, minimum=1)


def basic_composition(epsilon: float, delta: float, k: int) -> CompositionApproximation:
    """k runs of an (ε, δ)-DP mechanism are (kε, kδ)-DP (Dwork & Roth 2014, Thm 3.16).

    δ is capped at 1, where the bound says nothing.
    """
    epsilon, delta, k = _check_composition_inputs(epsilon, delta, k)
    return CompositionApproximation(
        k * epsilon, min(1.0, k * delta), "basic composition, Dwork & Roth 2014 Thm 3.16"
    )


def advanced_composition(
    epsilon: float, delta: float, k: int, delta_prime: float
) -> CompositionApproximation:
    """k adaptive runs of an (ε, δ)-DP mechanism are (ε', kδ + δ')-DP for any δ' in (0, 1).

    ε' = √(2k ln(1/δ'))·ε + k·ε·(e^ε − 1) (Dwork, Rothblum & Vadhan 2010; Dwork & Roth 2014,
    Thm 3.20). Beats basic composition for many runs of small ε; δ is capped at 1.
    """
    epsilon, delta, k = _check_composition_inputs(epsilon, delta, k)
    delta_prime = check_delta(delta_prime, "delta_prime")
    total = math.sqrt(2.0 * k * math.log(1.0 / delta_prime)) * epsilon
    total += k * epsilon * math.expm1(epsilon)
    return CompositionApproximation(
        total,
        min(1.0, k * delta + delta_prime),
        "advanced composition, Dwork, Rothblum & Vadhan 2010 / Dwork & Roth 2014 Thm 3.20",
    )


# -- the guide's scaling law -------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingLawFit:
    """Constants (A, B) of ε ≈ A·q·√k/σ + B·k·q²/σ², fitted per δ against one accountant."""

    accountant: str
    reference: str
    deltas: tuple[float, ...]
    a: tuple[float, ...]
    b: tuple[float, ...]
    max_relative_error: float
    median_relative_error: float
    sampling_rate_range: tuple[float, float]
    noise_multiplier_range: tuple[float, float]
    steps_range: tuple[int, int]
    min_epochs: float
    epsilon_range: tuple[float, float]

    def coefficients(self, delta: float) -> tuple[float, float]:
        """(A, B) at ``delta``: piecewise linear in log δ, extended linearly, clipped at 0."""
        nodes = sorted(zip(self.deltas, self.a, self.b, strict=True))
        t = math.log(delta)
        i = 0
        while i < len(nodes) - 2 and t > math.log(nodes[i + 1][0]):
            i += 1
        (d0, a0, b0), (d1, a1, b1) = nodes[i], nodes[i + 1]
        w = (t - math.log(d0)) / (math.log(d1) - math.log(d0))
        return max(0.0, a0 + w * (a1 - a0)), max(0.0, b0 + w * (b1 - b0))

    def outside(
        self, sampling_rate: float, steps: int, noise_multiplier: float, delta: float
    ) -> list[str]:
        """Which inputs lie outside the region the constants were fitted on."""
        checks = (
            ("sampling_rate", sampling_rate, self.sampling_rate_range),
            ("steps", steps, self.steps_range),
            ("noise_multiplier", noise_multiplier, self.noise_multiplier_range),
            ("delta", delta, (min(self.deltas), max(self.deltas))),
        )
        notes = [
            f"{name}={value:.3g} outside the fitted [{lo:g}, {hi:g}]"
            for name, value, (lo, hi) in checks
            if not lo * (1 - 1e-9) <= value <= hi * (1 + 1e-9)
        ]
        if sampling_rate * steps < self.min_epochs:
            notes.append(
                f"q·k={sampling_rate * steps:.3g} expected epochs, below the fitted "
                f"{self.min_epochs:g}"
            )
        return notes


SCALING_LAW_FITS: dict[str, ScalingLawFit] = {
    "pld": ScalingLawFit(
        accountant="pld",
        reference="dp_accounting 0.6.0 PLDAccountant (discretisation refined to < 0.2% change)",
        deltas=(1e-5, 1e-6, 1e-7),
        a=(4.0948, 4.7526, 5.3300),
        b=(0.7560, 0.7457, 0.7962),
        max_relative_error=0.16,
        median_relative_error=0.10,
        sampling_rate_range=(1e-4, 0.05),
        noise_multiplier_range=(1.5, 5.0),
        steps_range=(100, 100_000),
        min_epochs=1.0,
        epsilon_range=(1.0, 20.0),
    ),
    "rdp": ScalingLawFit(
        accountant="rdp",
        reference="dp_accounting 0.6.0 RdpAccountant (default orders)",
        deltas=(1e-5, 1e-6, 1e-7),
        a=(4.5446, 5.3937, 6.0452),
        b=(0.7835, 0.1444, 0.0000),
        max_relative_error=0.20,
        median_relative_error=0.08,
        sampling_rate_range=(1e-4, 0.05),
        noise_multiplier_range=(1.5, 5.0),
        steps_range=(100, 100_000),
        min_epochs=1.0,
        epsilon_range=(1.0, 20.0),
    ),
}
"""Scaling-law constants by accountant name, from ``benchmarks/fit_scaling_law.py`` (see above).

Errors are the fit's measured relative errors rounded up to a whole percent: max over the grid and
the validation points, and the larger median of the two.
"""


def _fit(accountant: str) -> ScalingLawFit:
    """Look up the constants fitted against ``accountant``, with an error listing the choices."""
    key = str(accountant).strip().lower()
    if key not in SCALING_LAW_FITS:
        choices = ", ".join(sorted(SCALING_LAW_FITS))
        raise ValueError(f"accountant must be one of {choices}; got {accountant!r}")
    return SCALING_LAW_FITS[key]


@dataclass(frozen=True)
class ScalingLawEstimate:
    """One (q, k, σ, ε, δ) point of the scaling law, one of ε or σ solved from the others.

    ``is_approximation`` is always True; ``notes`` says when the point lies outside the region the
    constants were fitted on, where the stated error does not apply.
    """

    sampling_rate: float
    steps: int
    noise_multiplier: float
    epsilon: float
    delta: float
    accountant: str
    solved_for: str
    a: float
    b: float
    max_relative_error: float
    notes: tuple[str, ...] = ()
    is_approximation: bool = field(default=True, init=False)

    @property
    def in_fit_range(self) -> bool:
        """Whether the fitted error bound applies (all inputs and ε inside the fitted region)."""
        return not self.notes

    @property
    def label(self) -> str:
        """What produced the number, in words a report can quote."""
        return (
            f"approximation (guide App. B scaling law ε ≈ A·q·√k/σ + B·k·q²/σ², A={self.a:.4g}, "
            f"B={self.b:.4g}, fitted to {self.accountant.upper()}; max relative error "
            f"{self.max_relative_error:.0%} inside the fitted region)"
        )

    def bracket(self) -> tuple[float, float]:
        """A range for the exact value, from the fit's max relative error (fitted region only).

        For ε: [ε/(1+e), ε/(1−e)]. For σ: the law's σ at target ε·(1+e) and ε·(1−e). An initial
        bracket for exact calibration, still to be checked with an accountant at both ends.
        """
        e = self.max_relative_error
        if self.solved_for == "epsilon":
            high = self.epsilon / (1.0 - e) if e < 1.0 else math.inf
            return self.epsilon / (1.0 + e), high
        coefficients = (self.a, self.b)
        low = _solve_noise(self.sampling_rate, self.steps, self.epsilon * (1.0 + e), *coefficients)
        high = (
            _solve_noise(self.sampling_rate, self.steps, self.epsilon * (1.0 - e), *coefficients)
            if e < 1.0
            else math.inf
        )
        return low, high

    def __str__(self) -> str:
        point = (
            f"q={self.sampling_rate:.3g}, k={self.steps}, σ={self.noise_multiplier:.4g}, "
            f"ε={self.epsilon:.4g}, δ={self.delta:.3g}"
        )
        where = "" if self.in_fit_range else " Outside the fit: " + "; ".join(self.notes) + "."
        return (
            f"approximation: {self.solved_for} ≈ {getattr(self, self.solved_for):.4g} ({point}); "
            f"{self.label}; {_REPORT_HINT}.{where}"
        )


def _law_epsilon(q: float, steps: int, sigma: float, a: float, b: float) -> float:
    """A·q·√k/σ + B·k·q²/σ²."""
    return a * q * math.sqrt(steps) / sigma + b * steps * q * q / (sigma * sigma)


def _solve_noise(q: float, steps: int, epsilon: float, a: float, b: float) -> float:
    """σ from the law: the positive root of B·k·q²·x² + A·q·√k·x − ε = 0 in x = 1/σ.

    Written as σ = (A·q·√k + √(A²q²k + 4Bkq²ε)) / (2ε), which has no cancellation.
    """
    linear = a * q * math.sqrt(steps)
    return (linear + math.sqrt(linear * linear + 4.0 * b * steps * q * q * epsilon)) / (
        2.0 * epsilon
    )


def _coefficients(fit: ScalingLawFit, delta: float) -> tuple[float, float]:
    """(A, B) at δ, refusing δ so far out that the extrapolated constants make no sense."""
    a, b = fit.coefficients(delta)
    if a <= 0.0:
        raise ValueError(
            f"delta={delta:g} is too far outside the δ the scaling law was fitted for "
            f"({min(fit.deltas):g} to {max(fit.deltas):g}); use an accountant"
        )
    return a, b


def _estimate(
    fit: ScalingLawFit,
    q: float,
    steps: int,
    sigma: float,
    epsilon: float,
    delta: float,
    solved_for: str,
    a: float,
    b: float,
) -> ScalingLawEstimate:
    """Package a point with its provenance and any fitted-region warnings."""
    notes = fit.outside(q, steps, sigma, delta)
    lo, hi = fit.epsilon_range
    if not lo <= epsilon <= hi:
        notes.append(f"epsilon={epsilon:.3g} outside the fitted [{lo:g}, {hi:g}]")
    if not min(fit.deltas) <= delta <= max(fit.deltas):
        notes.append("A and B extrapolated linearly in log δ")
    return ScalingLawEstimate(
        sampling_rate=q,
        steps=steps,
        noise_multiplier=sigma,
        epsilon=epsilon,
        delta=delta,
        accountant=fit.accountant,
        solved_for=solved_for,
        a=a,
        b=b,
        max_relative_error=fit.max_relative_error,
        notes=tuple(notes),
    )


def scaling_law_epsilon(
    sampling_rate: float,
    steps: int,
    noise_multiplier: float,
    delta: float,
    accountant: str = "pld",
) -> ScalingLawEstimate:
    """Approximate DP-SGD ε with the guide's scaling law (§4.2.2, App. B) — not for reports.

    ``accountant`` picks the constants: fitted against dp_accounting's "pld" or "rdp". Between the
    fitted δ the constants are interpolated linearly in log δ; outside, extrapolated (noted).
    """
    q = check_sampling_rate(sampling_rate)
    steps = check_count("steps", steps, minimum=1)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    delta = check_delta(delta)
    fit = _fit(accountant)
    a, b = _coefficients(fit, delta)
    epsilon = _law_epsilon(q, steps, sigma, a, b)
    return _estimate(fit, q, steps, sigma, epsilon, delta, "epsilon", a, b)


def scaling_law_noise_multiplier(
    sampling_rate: float,
    steps: int,
    target_epsilon: float,
    delta: float,
    accountant: str = "pld",
) -> ScalingLawEstimate:
    """Approximate the σ that reaches ``target_epsilon`` by inverting the scaling law.

    Solves the quadratic in 1/σ exactly, so ``scaling_law_epsilon`` at the returned σ gives
    ``target_epsilon`` back. Use it (and ``bracket()``) to start an exact calibration.
    """
    q = check_sampling_rate(sampling_rate)
    steps = check_count("steps", steps, minimum=1)
    epsilon = check_positive("target_epsilon", target_epsilon)
    delta = check_delta(delta)
    fit = _fit(accountant)
    a, b = _coefficients(fit, delta)
    sigma = _solve_noise(q, steps, epsilon, a, b)
    return _estimate(fit, q, steps, sigma, epsilon, delta, "noise_multiplier", a, b)
