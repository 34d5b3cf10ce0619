"""One total ε for tuning and the final run: how it is split, and both σ calibrated to hold it.

The budget is the total the final run's report states: the final run's training steps and the
one tuning event composed by the run's accountant at the run's δ (guide §5.4.2: tuning runs are
accounted beside training). ε does not add under composition — PLD and RDP compose more tightly
than the sum — so the split is made on the tuning side and the final run takes what is left:

* with a ``tuning_share`` s, the trials' σ is the smallest whose tuning event alone spends
  s × total; the final run's σ is then the smallest whose steps, composed with that tuning
  event, keep the total within the budget (its own ε ends up above (1 − s) × total);
* without one (``None``), one σ serves the trials and the final run — the trials see the noise
  the final run trains with (guide §5.4.1: tune lr and C at the σ you will use) — the smallest
  that keeps the total within the budget; the share is then whatever the trials cost.

Public tuning spends nothing, so the final run is calibrated for the whole budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpfy._validate import check_positive, check_range
from dpfy.plan.accounting.accountant import compute_epsilon, make_accountant
from dpfy.plan.accounting.calibrate import CalibrationError, smallest_noise_multiplier
from dpfy.plan.accounting.events import ComposedEvent, DpEvent

#: A function from a noise multiplier σ to the privacy event of what would run at that σ.
EventAt = Callable[[float], DpEvent]

#: Calibrations aim this fraction below the budget. The final run recalibrates its own σ for its
#: training ε (that ε is its budget guard), which may land a rounding step lower; the margin keeps
#: the total within the budget after that step. It wastes at most this fraction of the budget.
CALIBRATION_MARGIN = 1e-3

#: Default ε of the exponential mechanism's selection, as a fraction of the total budget.
SELECTION_SHARE = 0.1


def check_tuning_share(share: float | None) -> float | None:
    """A tuning share is a fraction strictly inside (0, 1), or None (one σ for everything)."""
    if share is None:
        return None
    try:
        return check_range("tuning_share", share, 0.0, 1.0)
    except ValueError:
        raise ValueError(
            f"--tuning-share must lie in (0, 1), got {share!r}: it is the fraction of the total "
            "ε the tuning trials may spend, e.g. 0.3; omit it to run the trials at the final "
            "run's σ"
        ) from None


def composed_total(
    training: DpEvent, tuning: DpEvent | None, delta: float, accountant: str
) -> float:
    """The total ε as the final run's ledger states it: both events in one accountant."""
    fresh = make_accountant(accountant)
    fresh.compose(training)
    if tuning is not None:
        fresh.compose(tuning)
    return fresh.epsilon(delta)


@dataclass(frozen=True)
class BudgetSplit:
    """The planned split: both σ, the tuning event they imply, and the ε of each part."""

    total_epsilon: float
    tuning_share: float | None
    delta: float
    accountant: str
    trial_noise_multiplier: float
    final_noise_multiplier: float
    tuning_event: DpEvent | None  # None: public tuning, nothing recorded
    tuning_epsilon: float
    training_epsilon: float  # the final run's steps alone: its budget guard's target
    planned_total: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON for tuning.json (the event itself is in the final run's ledger)."""
        return {
            "total_epsilon": self.total_epsilon,
            "tuning_share": self.tuning_share,
            "tuning_epsilon": self.tuning_epsilon,
            "training_epsilon": self.training_epsilon,
            "planned_total": self.planned_total,
            "trial_noise_multiplier": self.trial_noise_multiplier,
            "final_noise_multiplier": self.final_noise_multiplier,
            "accountant": self.accountant,
            "delta": self.delta,
        }


def _smallest(event_at: EventAt, target: float, delta: float, accountant: str, what: str) -> float:
    """The smallest σ whose event meets ``target``, or one error naming what to change."""
    try:
        return smallest_noise_multiplier(event_at, target, delta, accountant=accountant)
    except CalibrationError:
        raise ValueError(
            f"no noise multiplier makes {what} fit ε = {target:.4g} at δ = {delta:g}; raise "
            "--target-epsilon (or --tuning-share), or run fewer or shorter trials"
        ) from None


def _together(training_at: EventAt, tuning_at: EventAt | None) -> EventAt:
    """σ ↦ the final run's steps composed with the tuning, both at σ."""
    if tuning_at is None:
        return training_at
    return lambda sigma: ComposedEvent((training_at(sigma), tuning_at(sigma)))


def plan_budget(
    total_epsilon: float,
    delta: float,
    accountant: str,
    training_at: EventAt,
    tuning_at: EventAt | None,
    tuning_share: float | None = None,
) -> BudgetSplit:
    """Split ``total_epsilon`` between the trials (``tuning_at``) and the final run.

    ``tuning_at`` is None for public tuning (the final run then gets everything). The result's
    ``planned_total`` is checked here with the accountant the report uses and never exceeds the
    budget.
    """
    total = check_positive("total_epsilon", total_epsilon)
    share = check_tuning_share(tuning_share)
    aim = total * (1.0 - CALIBRATION_MARGIN)
    if tuning_at is None or share is None:
        sigma = _smallest(
            _together(training_at, tuning_at),
            aim,
            delta,
            accountant,
            "the trials and the final run",
        )
        trial_sigma = sigma
    else:
        trial_sigma = _smallest(
            tuning_at, share * aim, delta, accountant, f"the trials in {share:g} of the budget"
        )
        tuning = tuning_at(trial_sigma)
        sigma = _smallest(
            lambda s: ComposedEvent((training_at(s), tuning)), aim, delta, accountant,
            "the final run beside the trials",
        )  # fmt: skip
    tuning_event = None if tuning_at is None else tuning_at(trial_sigma)
    planned = composed_total(training_at(sigma), tuning_event, delta, accountant)
    if planned > total:
        raise RuntimeError(
            f"the planned total ε {planned:.6g} exceeds the budget {total:.6g} after calibration; "
            "nothing was run — please report this"
        )
    return BudgetSplit(
        total_epsilon=total,
        tuning_share=share,
        delta=delta,
        accountant=accountant,
        trial_noise_multiplier=trial_sigma,
        final_noise_multiplier=sigma,
        tuning_event=tuning_event,
        tuning_epsilon=0.0
        if tuning_event is None
        else compute_epsilon(tuning_event, delta, accountant),
        training_epsilon=compute_epsilon(training_at(sigma), delta, accountant),
        planned_total=planned,
    )


__all__ = [
    "CALIBRATION_MARGIN",
    "SELECTION_SHARE",
    "BudgetSplit",
    "EventAt",
    "check_tuning_share",
    "composed_total",
    "plan_budget",
]
