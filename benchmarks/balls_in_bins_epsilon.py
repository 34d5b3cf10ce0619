"""ε at δ = 1e-5 of 10 epochs over N = 60 000 examples in batches of B = 256 (k = 234 steps per
epoch): balls-in-bins without amplification (one Gaussian per epoch), dpfy's random-allocation
bound, and Poisson sampling at q = 1/k (dp_accounting, for comparison); then long epochs
(k = 2000 and 10 000 steps, σ = 1, δ = 1e-6).

    .venv/bin/python benchmarks/balls_in_bins_epsilon.py
"""

from __future__ import annotations

import dp_accounting as dpa

from dpfy.plan.accounting import GaussianEvent, SelfComposedEvent, make_accountant
from dpfy.plan.accounting.events import BallsInBinsEpochEvent

N, B, EPOCHS, DELTA = 60_000, 256, 10, 1e-5


def main() -> None:
    k = N // B
    print(f"N = {N}, B = {B}, k = {k} steps per epoch, {EPOCHS} epochs, delta = {DELTA:g}")
    print("| σ | no amplification | random allocation (dpfy) | Poisson q = 1/k (dp_accounting) |")
    print("|---|---|---|---|")
    for sigma in (0.8, 1.0):
        plain = make_accountant("pld").compose(GaussianEvent(sigma), EPOCHS).epsilon(DELTA)
        ours = (
            make_accountant("pld")
            .compose(SelfComposedEvent(BallsInBinsEpochEvent(sigma, k), EPOCHS))
            .epsilon(DELTA)
        )
        poisson = dpa.pld.PLDAccountant()
        poisson.compose(
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(1 / k, dpa.GaussianDpEvent(sigma)), k * EPOCHS
            )
        )
        print(f"| {sigma} | {plain:.2f} | {ours:.3f} | {poisson.get_epsilon(DELTA):.3f} |")
    print()
    print("| k | epochs | random allocation (dpfy) | Poisson q = 1/k (dp_accounting) |")
    print("|---|---|---|---|")
    for steps, epochs in ((2000, 5), (10_000, 3)):
        ours = make_accountant("pld").compose(BallsInBinsEpochEvent(1.0, steps), epochs)
        poisson = dpa.pld.PLDAccountant()
        poisson.compose(
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(1 / steps, dpa.GaussianDpEvent(1.0)), steps * epochs
            )
        )
        print(
            f"| {steps} | {epochs} | {ours.epsilon(1e-6):.3f} | {poisson.get_epsilon(1e-6):.3f} |"
        )


if __name__ == "__main__":
    main()
