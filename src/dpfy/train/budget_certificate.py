"""The budget guard's certificates, for runs whose σ or q changes every step: one covers many
different steps, so the accountant is asked again only now and then.

A certificate names a *ceiling* step s* — a Poisson-sampled Gaussian with a larger rate q* and a
smaller noise multiplier σ* than the step that asked — and a room m, verified with the
accountant's bound variant: ε(ledger + m × s*) ≤ target·(1 − ``MARGIN``). Any later step whose
q ≤ q* and σ ≥ σ* is dominated by s* (it is s* post-processed: subsample the sample, add noise),
composition preserves domination, and ε cannot decrease with more or costlier steps, so each
such step may spend one unit of the room without asking the accountant. A coordinate that no
sampled Gaussian of the ledger has varied yet is *pinned* (a covered step must match it
exactly), so the accountant's own coarsening of many distinct steps (which leaves unvaried
coordinates exact) cannot change under the certificate.

The margin covers discretisation noise between the accounted ε of two compositions ordered by
domination; within it of the target the guard asks the accountant about each step itself, so the
step that would cross the target is refused exactly as without certificates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)

#: Relative headroom a certificate leaves below the target (see module).
MARGIN = 1e-3
#: How much costlier than the step that asked the ceiling is, per coordinate: a wider box
#: covers more of a schedule, a narrower one charges each covered step less.
WIDEN = 0.05
#: The room first tried when no earlier certificate says how many steps one covers.
FIRST_GUESS = 16


def sampled_gaussian(event: DpEvent) -> tuple[float, float] | None:
    """(q, σ) of a Poisson-sampled Gaussian step with q < 1, else None."""
    sampled = type(event) is PoissonSampledEvent and type(event.event) is GaussianEvent
    if sampled and event.sampling_rate < 1.0:
        return event.sampling_rate, event.event.noise_multiplier
    return None


def _sampled_gaussians(event: DpEvent) -> Iterator[tuple[float, float]]:
    """Every sampled Gaussian inside ``event`` (through composition), as (q, σ)."""
    stack = [event]
    while stack:
        current = stack.pop()
        if isinstance(current, ComposedEvent):
            stack.extend(current.events)
        elif isinstance(current, SelfComposedEvent):
            stack.append(current.event)
        elif isinstance(current, PoissonSampledEvent):
            found = sampled_gaussian(current)
            if found is not None:
                yield found
            elif isinstance(current.event, PoissonSampledEvent):
                yield (-1.0, -1.0)  # nested sampling: counts as varying both coordinates


@dataclass
class Certificate:
    """Room for ``room`` more steps dominated by ``ceiling`` (see module); ``used`` counts the
    steps it has covered, which sizes the next certificate."""

    rate: float
    noise: float
    pin_rate: bool
    pin_noise: bool
    room: int
    used: int = 0

    @property
    def ceiling(self) -> DpEvent:
        """The step every covered step is dominated by."""
        return PoissonSampledEvent(self.rate, GaussianEvent(self.noise))

    def covers(self, event: DpEvent) -> bool:
        """Whether ``event`` is dominated by the ceiling and matches its pinned coordinates."""
        found = sampled_gaussian(event)
        if found is None:
            return False
        q, sigma = found
        rate_ok = q == self.rate if self.pin_rate else q <= self.rate
        noise_ok = sigma == self.noise if self.pin_noise else sigma >= self.noise
        return rate_ok and noise_ok


def ceiling_for(event: DpEvent, recorded: Iterable[DpEvent]) -> Certificate | None:
    """An empty certificate whose ceiling covers ``event``, pinning what ``recorded`` never
    varied; None when ``event`` is not a sampled Gaussian or widening q would reach 1."""
    found = sampled_gaussian(event)
    if found is None:
        return None
    q, sigma = found
    rates, noises = {q}, {sigma}
    for inner in recorded:
        for rate, noise in _sampled_gaussians(inner):
            rates.add(rate)
            noises.add(noise)
    pin_rate, pin_noise = len(rates) == 1, len(noises) == 1
    rate = q if pin_rate else q * (1 + WIDEN)
    if rate >= 1.0:
        return None
    noise = sigma if pin_noise else sigma / (1 + WIDEN)
    return Certificate(rate, noise, pin_rate, pin_noise, room=0)


def certified_room(fits: Callable[[int], bool], guess: int) -> int:
    """A room m ≥ 0 with fits(m) (0 if even one step does not fit), in few accountant queries:
    the guess if it fits, else a quarter of it, and so on."""
    m = max(1, guess)
    while m >= 1:
        if fits(m):
            return m
        m //= 4
    return 0
