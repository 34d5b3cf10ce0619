"""What tuning on private data costs: four accounting methods, one registry (guide §5.4.2).

Each method turns the event of one tuning trial (a short DP-SGD run, recorded from what actually
happened) into the single event the ledger records under the label ``"tuning"``, says which
accountant can bound it, how the best trial may be selected, and what it assumes:

``compose``
    Every trial is extra training: the K trial events compose (the guide's "treat each tuning run
    as an extra epoch", §5.4.2, app. C). Any selection rule is then post-processing of the K
    accounted runs. Assumes the validation scores come from data outside the protected training
    set (the held-out validation split is not covered by ε).
``exponential``
    The K trial runs compose as above, and the choice among them is made by the exponential
    mechanism on the number of correctly classified validation examples (McSherry & Talwar 2007,
    Thm 6; Dwork & Roth 2014, Thm 3.10): one record changes that count by at most 1, so the
    selection is ``selection_epsilon``-DP and the validation split is protected too. Cost:
    composition of the K runs plus ``PureDpEvent(selection_epsilon)`` — never below ``compose``.
    We know of no theorem that lets an exponential-mechanism choice replace the composition of the
    candidates' training runs: the candidate models read the training data, and the scores read
    the models. The result that does avoid paying K times (Liu & Talwar 2019, random stopping) needs
    a *random* number of runs — that is the ``random-trials`` method, whose geometric case is Liu &
    Talwar's with Papernot & Steinke's tighter Rényi analysis.
``random-trials``
    The number of runs K is drawn at random — Poisson, or truncated negative binomial (geometric,
    logarithmic) — and only the best run is released (Papernot & Steinke 2022, Thm 2 and Thm 6;
    :class:`~dpfy.plan.accounting.events.RepeatAndSelectEvent`). The tuner really draws K; every run
    draws its configuration afresh from the candidates, so each run is the same mechanism Q, and
    the best run is chosen by a fixed total order on single-run outputs. RDP accounting only. Like
    ``compose`` it assumes the score each run reports is computed on data outside the protected set.
``public``
    Tuning ran on data the trainer declares public (not part of the protected training set): no
    privacy cost, and the declaration is required and reported.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    NoOpEvent,
    PureDpEvent,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    TrialDistribution,
)

#: Selection rules a method may use (see :mod:`dpfy.tune.tuner`).
SELECT_BY_SEARCH_RULE = "search-rule"
SELECT_BY_ORDER = "fixed-order"
SELECT_BY_EXPONENTIAL = "exponential-mechanism"


@dataclass(frozen=True)
class TuningSpec:
    """The method's parameters: distribution and mean for random trials, ε of the selection."""

    distribution: TrialDistribution | str = TrialDistribution.POISSON
    shape: float | None = None
    mean_trials: float | None = None
    selection_epsilon: float = 1.0
    public_declaration: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "distribution", TrialDistribution.parse(self.distribution))
        check_positive("selection_epsilon", self.selection_epsilon)
        if self.mean_trials is not None:
            check_positive("mean_trials", self.mean_trials)


@dataclass(frozen=True)
class TuningAccounting:
    """One way to account tuning runs: how many runs, which event, which selection, which theory."""

    name: str
    description: str
    theorem: str
    assumptions: str
    selection: str
    accountant: str | None  # the accountant the event needs, or None if any registered one works
    private: bool  # whether the trials touch the protected data (False only for 'public')
    build: Callable[[Sequence[DpEvent], TuningSpec], DpEvent]
    # Whether ε also covers publishing every trial's score (and, for random trials, K). False
    # when the theorem accounts only for the selected output.
    covers_all_trials: bool = True

    def event(self, trial_events: Sequence[DpEvent], spec: TuningSpec) -> DpEvent:
        """The one event the ledger records for these trials (each trial's own event given)."""
        return self.build(list(trial_events), spec)


TUNING_METHODS: dict[str, TuningAccounting] = {}


def register_method(method: TuningAccounting) -> TuningAccounting:
    """Make a tuning-accounting method available by name (no if/elif dispatch)."""
    if method.name in TUNING_METHODS:
        raise ValueError(f"tuning accounting method {method.name!r} is already registered")
    TUNING_METHODS[method.name] = method
    return method


def get_method(name: str | None) -> TuningAccounting:
    """The method called ``name``; None or an unknown name is refused with the choices listed."""
    choices = ", ".join(f"{m.name} ({m.description})" for m in TUNING_METHODS.values())
    if name is None or not str(name).strip():
        raise ValueError(
            "tuning on private data needs an accounting method, and none was chosen; choose one "
            f"of: {choices}"
        )
    key = str(name).strip().lower()
    if key not in TUNING_METHODS:
        raise ValueError(f"unknown tuning accounting method {name!r}; choose one of: {choices}")
    return TUNING_METHODS[key]


def _composed(trial_events: Sequence[DpEvent]) -> DpEvent:
    """K trial events in sequence, identical ones grouped into one self-composition."""
    if not trial_events:
        raise ValueError("no tuning trial ran, so there is nothing to account")
    counts: dict[DpEvent, int] = {}
    for event in trial_events:
        counts[event] = counts.get(event, 0) + 1
    parts = tuple(e if c == 1 else SelfComposedEvent(e, c) for e, c in counts.items())
    return parts[0] if len(parts) == 1 else ComposedEvent(parts)


def _compose_event(trial_events: Sequence[DpEvent], spec: TuningSpec) -> DpEvent:
    """Basic adaptive composition of every trial run (guide §5.4.2, app. C)."""
    return _composed(trial_events)


def _exponential_event(trial_events: Sequence[DpEvent], spec: TuningSpec) -> DpEvent:
    """Composition of the trial runs plus an ε_sel-DP exponential-mechanism selection."""
    return ComposedEvent((_composed(trial_events), PureDpEvent(spec.selection_epsilon)))


def single_trial_event(trial_events: Sequence[DpEvent]) -> DpEvent:
    """The one mechanism Q every random-trials run is; refuse runs with different events.

    Papernot & Steinke's theorems repeat one mechanism Q: every candidate configuration must have
    the same privacy event (same q, σ and steps; the learning rate and C may differ).
    """
    distinct = set(trial_events)
    if len(distinct) != 1:
        raise ValueError(
            f"random-trials accounting needs every trial to be the same mechanism, but the "
            f"candidates have {len(distinct)} different privacy events (batch size, σ or steps "
            "differ); fix those and vary only the learning rate and clip norm, or use 'compose'"
        )
    return next(iter(distinct))


def _random_trials_event(trial_events: Sequence[DpEvent], spec: TuningSpec) -> DpEvent:
    """Repeat-and-select with a random number of runs (Papernot & Steinke 2022)."""
    if spec.mean_trials is None:
        raise ValueError("random-trials accounting needs the mean number of trials (mean_trials)")
    base = single_trial_event(trial_events) if trial_events else None
    if base is None:
        raise ValueError("random-trials accounting needs the event of one trial run")
    return RepeatAndSelectEvent(base, spec.mean_trials, spec.distribution, spec.shape)


def _public_event(trial_events: Sequence[DpEvent], spec: TuningSpec) -> DpEvent:
    """No private data touched: a no-op kept for the record."""
    return NoOpEvent()


register_method(
    TuningAccounting(
        name="compose",
        description="each trial counted as extra training",
        theorem="adaptive composition of the K trial runs (guide §5.4.2, app. C)",
        assumptions=(
            "validation scores come from data outside the protected training set; that "
            "validation data is not covered by ε"
        ),
        selection=SELECT_BY_SEARCH_RULE,
        accountant=None,
        private=True,
        build=_compose_event,
    )
)
register_method(
    TuningAccounting(
        name="exponential",
        description="trials composed, best chosen by the exponential mechanism",
        theorem=(
            "composition of the K trial runs plus the exponential mechanism on validation "
            "counts (McSherry & Talwar 2007, Thm 6; Dwork & Roth 2014, Thm 3.10), ε_sel-DP"
        ),
        assumptions=(
            "the score is the number of correct validation predictions (sensitivity 1 under "
            "add-or-remove); the candidate set is fixed before the data is seen; the validation "
            "split is protected by ε_sel"
        ),
        selection=SELECT_BY_EXPONENTIAL,
        accountant=None,
        private=True,
        build=_exponential_event,
        covers_all_trials=False,  # the scores read the private validation split
    )
)
register_method(
    TuningAccounting(
        name="random-trials",
        description="random number of trials, best released (Papernot & Steinke 2022)",
        theorem=(
            "Papernot & Steinke 2022, Thm 6 (Poisson) and Thm 2 (truncated negative binomial; "
            "geometric η=1 is Liu & Talwar 2019's random stopping), Rényi DP"
        ),
        assumptions=(
            "K is really drawn from the stated distribution; every run draws its configuration "
            "afresh (one mechanism Q); only the best run by a fixed order is released; scores "
            "come from data outside the protected training set"
        ),
        selection=SELECT_BY_ORDER,
        accountant="rdp",
        private=True,
        build=_random_trials_event,
        covers_all_trials=False,  # only the best run is accounted; K and the others are not
    )
)
register_method(
    TuningAccounting(
        name="public",
        description="tuned on declared public data, no privacy cost",
        theorem="no protected record is touched, so nothing is spent (guide §5.4.2)",
        assumptions="the tuning data is public and disjoint from the protected training set",
        selection=SELECT_BY_SEARCH_RULE,
        accountant=None,
        private=False,
        build=_public_event,
    )
)


def draw_trial_count(spec: TuningSpec, generator: object) -> int:
    """Draw K from the method's distribution with a seedable ``numpy.random.Generator``.

    Poisson(μ); truncated negative binomial(η, γ) with P(K=k) ∝ C(k+η−1, k)·(1−γ)^k for k ≥ 1
    (Papernot & Steinke 2022, §2), γ solved from the mean; η=1 is geometric, η=0 logarithmic.
    """
    import numpy as np

    if not isinstance(generator, np.random.Generator):
        raise ValueError("generator must be a numpy.random.Generator (np.random.default_rng(seed))")
    if spec.mean_trials is None:
        raise ValueError("random trials need mean_trials, the expected number of runs")
    mean = spec.mean_trials
    dist = spec.distribution
    if dist is TrialDistribution.POISSON:
        return int(generator.poisson(mean))
    shape = {TrialDistribution.GEOMETRIC: 1.0, TrialDistribution.LOGARITHMIC: 0.0}.get(
        dist, spec.shape
    )
    if shape is None:
        raise ValueError("the truncated negative binomial needs a shape η in (-1, inf)")
    return _draw_truncated_negative_binomial(mean, float(shape), generator)


def _draw_truncated_negative_binomial(mean: float, shape: float, generator: object) -> int:
    """Inverse-CDF draw from the truncated negative binomial with the given mean and shape η."""
    if mean <= 1.0:
        return 1
    gamma = _gamma(mean, shape)
    u = float(generator.random())  # type: ignore[attr-defined]
    # Unnormalised weights w_k = Γ(k+η)/(Γ(η) k!) (1−γ)^k built by the ratio w_{k+1}/w_k.
    total = _tnb_normaliser(shape, gamma)
    weight = (shape if shape != 0 else 1.0) * (1 - gamma)  # w_1 (η=0: the logarithmic limit)
    cumulative, k = 0.0, 1
    while True:
        cumulative += weight / total
        if u <= cumulative or k > 10_000_000:
            return k
        weight *= (k + shape) / (k + 1) * (1 - gamma)
        k += 1


@functools.lru_cache(maxsize=64)
def _gamma(mean: float, shape: float) -> float:
    """γ of the truncated negative binomial with this mean (solved once, then cached)."""
    from dpfy.plan.accounting.rdp_repeat_and_select import _log_inverse_gamma

    return math.exp(-_log_inverse_gamma(mean, shape))  # it returns t = log(1/γ)


def _tnb_normaliser(shape: float, gamma: float) -> float:
    """Σ_{k≥1} w_k: γ^{−η} − 1 for η ≠ 0 and log(1/γ) for η = 0 (negative binomial series)."""
    if shape == 0:
        return -math.log(gamma)
    return gamma**-shape - 1.0


def check_trial_count(value: int) -> int:
    """A number of trials is a whole number ≥ 1."""
    return check_count("trials", value, minimum=1)


__all__ = [
    "SELECT_BY_EXPONENTIAL",
    "SELECT_BY_ORDER",
    "SELECT_BY_SEARCH_RULE",
    "TUNING_METHODS",
    "TuningAccounting",
    "TuningSpec",
    "check_trial_count",
    "draw_trial_count",
    "get_method",
    "register_method",
]
