"""The tuner: run a search's trials on the data, pick one, and account for it (guide §5.4.2).

:class:`Tuner` refuses to start unless the accounting is decided — tuning on private data with no
method is an error that lists the methods — and checks everything it can before
the first trial: a zero-noise trial has no finite ε and may only run on data declared public;
random-trials needs every candidate to be the same mechanism. For random-trials it really draws
the number of runs K from the chosen distribution with a seeded ``numpy`` generator, and every
run draws its configuration afresh from the candidates (Papernot & Steinke 2022). The outcome's
:meth:`TuningOutcome.record` writes the one tuning event into a
:class:`~dpfy.train.ledger.PrivacyLedger`
under the label ``"tuning"``, so the report card shows training ε, tuning ε and their total.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpfy._validate import check_delta
from dpfy.data.sampling import check_batch_size
from dpfy.plan.accounting.accountant import compute_epsilon
from dpfy.plan.accounting.events import (
    DpEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)
from dpfy.plan.mechanisms import exponential_mechanism
from dpfy.report.facts import TuningFacts
from dpfy.train.ledger import PrivacyLedger
from dpfy.tune.cost import (
    SELECT_BY_EXPONENTIAL,
    SELECT_BY_ORDER,
    TuningAccounting,
    TuningSpec,
    draw_trial_count,
    get_method,
    single_trial_event,
)
from dpfy.tune.search import Search
from dpfy.tune.trial import TrialConfig, TrialResult, TuningData, run_trial

TrialRunner = Callable[[TrialConfig, TuningData, float], TrialResult]
TrialCallback = Callable[[int, int, TrialResult], None]
TUNING_LABEL = "tuning"
_SPEC_HINT = (
    "the mean number of trials must exceed 1 for the truncated distributions, which never draw "
    "K = 0, and the truncated negative binomial needs a shape η in (-1, inf); or use Poisson"
)


def planned_event(config: TrialConfig, dataset_size: int) -> DpEvent | None:
    """The event a trial will record: ⌈E·N/B⌉ Poisson-sampled Gaussian steps (None if σ = 0)."""
    if config.noise_multiplier == 0.0:
        return None
    batch = check_batch_size(dataset_size, min(config.batch_size, dataset_size))
    steps = max(1, math.ceil(config.epochs * dataset_size / batch))
    step = PoissonSampledEvent(batch / dataset_size, GaussianEvent(config.noise_multiplier))
    return SelfComposedEvent(step, steps)


def _single(event: DpEvent) -> DpEvent:
    """A ledger's one-entry composition unwrapped, so it compares equal to the planned event."""
    parts = getattr(event, "events", None)
    return parts[0] if parts is not None and len(parts) == 1 else event


@dataclass
class TuningOutcome:
    """The trials run, the one chosen (None if random-trials drew K = 0), and the tuning event."""

    search: str
    method: TuningAccounting
    spec: TuningSpec
    results: list[TrialResult]
    chosen: TrialResult | None
    event: DpEvent
    delta: float
    trials_drawn: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def accountant(self) -> str:
        """The accountant that bounds this outcome's event."""
        return self.method.accountant or "pld"

    @property
    def epsilon(self) -> float:
        """ε of the tuning alone at the outcome's δ (0 for public data)."""
        if not self.method.private:
            return 0.0
        return compute_epsilon(self.event, self.delta, self.accountant)

    def record(self, ledger: PrivacyLedger) -> None:
        """Account the tuning in ``ledger`` (label "tuning"); public tuning records nothing."""
        if self.method.private:
            ledger.record_event(self.event, label=TUNING_LABEL)

    def facts(self) -> TuningFacts:
        """What the report card states about tuning."""
        return TuningFacts(
            data="private" if self.method.private else "public", trials=len(self.results)
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary of the tuning."""
        chosen = self.chosen
        return {
            "search": self.search,
            "accounting": {
                "method": self.method.name,
                "theorem": self.method.theorem,
                "assumptions": self.method.assumptions,
                "accountant": self.accountant if self.method.private else None,
                "distribution": self.spec.distribution.value
                if self.method.name == "random-trials"
                else None,
                "mean_trials": self.spec.mean_trials,
                "selection_epsilon": self.spec.selection_epsilon
                if self.method.selection == SELECT_BY_EXPONENTIAL
                else None,
                "public_declaration": self.spec.public_declaration,
            },
            "delta": self.delta,
            "tuning_epsilon": self.epsilon,
            "trials_covered_by_epsilon": self.method.covers_all_trials,
            "release_note": _release_note(self.method),
            "trials_run": len(self.results),
            "trials_drawn": self.trials_drawn,
            "trials": [
                {
                    "max_grad_norm": r.config.max_grad_norm,
                    "lr": r.config.lr,
                    "noise_multiplier": r.config.noise_multiplier,
                    "epochs": r.config.epochs,
                    "batch_size": r.config.batch_size,
                    "validation_accuracy": r.accuracy,
                    "validation_correct": r.correct,
                    "validation_size": r.evaluated,
                }
                for r in self.results
            ],
            "chosen": None
            if chosen is None
            else {
                "max_grad_norm": chosen.config.max_grad_norm,
                "lr": chosen.config.lr,
                "validation_accuracy": chosen.accuracy,
            },
            "notes": list(self.notes),
        }


def _release_note(method: TuningAccounting) -> str:
    """What of the trial record may be published under the method's guarantee."""
    if method.covers_all_trials:
        return "ε covers every trial listed here (their scores are post-processing)."
    return (
        f"The {method.name} guarantee covers only the selected configuration: the number of "
        "trials and the other trials' scores (listed here and drawn in the plots) are for the "
        "data curator and are not covered by ε — do not publish them."
    )


@dataclass
class Tuner:
    """Runs ``search`` under the accounting ``method`` (a name from ``TUNING_METHODS``)."""

    search: Search
    method: str | None
    spec: TuningSpec = field(default_factory=TuningSpec)
    #: Seeds the draw of K, each run's configuration and seed, and the exponential mechanism.
    #: None (the default) takes OS entropy: an adversary who knows the seed knows K, the
    #: selection's coin flips and every trial's noise, and the guarantees assume they are
    #: secret. Seed only experiments.
    seed: int | None = None
    runner: TrialRunner = run_trial

    def __post_init__(self) -> None:
        self._method = get_method(self.method)  # None: refused, with the choices listed
        if not self._method.private and not (self.spec.public_declaration or "").strip():
            raise ValueError(
                "'public' tuning costs nothing only for data that really is public: declare it "
                "(TuningSpec(public_declaration=...), or --public-data on the CLI), e.g. 'a "
                "disjoint split held out as public, never used for private training'"
            )

    def _check(self, candidates: Sequence[TrialConfig], dataset_size: int) -> list[DpEvent | None]:
        """Every problem that can be found before the first trial runs."""
        if not candidates:
            raise ValueError(f"the {self.search.name} search proposes no configuration to try")
        events = [planned_event(c, dataset_size) for c in candidates]
        if self._method.private and any(e is None for e in events):
            raise ValueError(
                "a zero-noise trial (σ = 0) on private data has no finite ε and cannot be "
                "accounted by any method; give the search the run's noise multiplier, or tune "
                "on data declared public (--tuning-accounting public --public-data ...)"
            )
        if self._method.selection == SELECT_BY_ORDER:
            single_trial_event([e for e in events if e is not None])
            if self.spec.mean_trials is None:
                raise ValueError("random-trials needs mean_trials, the expected number of runs")
        if self._method.private:  # the spec's own errors (a mean the distribution cannot have)
            try:
                self._method.event([e for e in events if e is not None], self.spec)
            except ValueError as error:
                raise ValueError(
                    f"{self._method.name} tuning settings: {error} ({_SPEC_HINT})"
                ) from None
        return events

    def _schedule(
        self, candidates: Sequence[TrialConfig], rng: np.random.Generator
    ) -> tuple[list[TrialConfig], int | None]:
        """Which configurations run: all of them, or K drawn ones, each chosen afresh.

        Unseeded, every run gets a seed from OS entropy, so no trial's noise or sampling follows
        the search's public default seed. Seeded (an experiment), every run is reproducible: a
        candidate without a seed of its own gets one derived from the tuner's.
        """
        if self._method.selection == SELECT_BY_ORDER:
            count: int | None = draw_trial_count(self.spec, rng)
            runs = [candidates[i] for i in rng.integers(len(candidates), size=count)]
        else:
            count, runs = None, list(candidates)
        if self.seed is None:
            seeds = rng.integers(2**31, size=len(runs))
            return [c.with_(seed=int(s)) for c, s in zip(runs, seeds, strict=True)], count
        if count is None:
            return [
                c if c.seed is not None else c.with_(seed=self.seed + 1 + n)
                for n, c in enumerate(runs)
            ], None
        return [c.with_(seed=self.seed + 1 + n) for n, c in enumerate(runs)], count

    def _select(self, results: list[TrialResult], rng: np.random.Generator) -> TrialResult | None:
        """Pick by the method's rule: the search's own, a fixed order, or the exponential
        mechanism on validation counts (sensitivity 1)."""
        if not results:
            return None
        if self._method.selection == SELECT_BY_ORDER:
            return max(results, key=self.search.rank_key)
        if self._method.selection == SELECT_BY_EXPONENTIAL:
            scores = [float(r.correct) for r in results]
            return exponential_mechanism(
                results, scores, self.spec.selection_epsilon, sensitivity=1.0, rng=rng
            ).output
        return self.search.choose(results)

    def run(
        self, data: TuningData, delta: float, on_trial: TrialCallback | None = None
    ) -> TuningOutcome:
        """Run the trials, choose, and build the tuning event from what ran."""
        delta = check_delta(delta)
        candidates = self.search.candidates()
        size = len(data.train)  # type: ignore[arg-type]
        events = self._check(candidates, size)
        rng = np.random.default_rng(self.seed)
        schedule, drawn = self._schedule(candidates, rng)
        results: list[TrialResult] = []
        for index, config in enumerate(schedule):
            result = self.runner(config, data, delta)
            planned = planned_event(config, size)
            if result.event is not None and _single(result.event) != planned:
                raise RuntimeError(
                    f"trial {index} recorded {result.event} but {planned} was planned; the "
                    "accounting would not describe what ran"
                )
            results.append(result)
            if on_trial is not None:
                on_trial(index, len(schedule), result)
        chosen = self._select(results, rng)
        ran = [planned_event(c, size) for c in schedule]
        trial_events = [e for e in ran if e is not None]
        if self._method.private and not trial_events:
            trial_events = [e for e in events if e is not None]  # K = 0: Q is still defined
        event = self._method.event(trial_events, self.spec)
        notes = []
        if drawn == 0:
            notes.append(
                "random-trials drew K = 0 runs: nothing was selected, and the cost of that draw "
                "is still accounted; train with the untuned default"
            )
        return TuningOutcome(
            self.search.name, self._method, self.spec, results, chosen, event, delta, drawn, notes
        )


__all__ = ["TUNING_LABEL", "Tuner", "TuningOutcome", "planned_event"]
