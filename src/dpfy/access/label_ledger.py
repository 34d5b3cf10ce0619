"""The label-DP ledger: which labels were randomised, how often, at what ε, and the ε that follows.

Label-only DP (guide §3.2; Ghazi et al. 2021) protects each example's label against an adversary
who knows every feature: neighbouring datasets differ in the label of one example. Randomised
response on a label is ε-DP for that label, so the accounting is per example:

- *parallel composition* over examples — releases that touch disjoint sets of labels (the examples
  of one pass, or the disjoint stages of RR-with-prior) do not add up: each label's guarantee
  depends only on the releases of that label (McSherry 2009, "Privacy integrated queries", Thm 4);
- *sequential composition* on one example — a label randomised twice at ε₁ and ε₂ is
  (ε₁ + ε₂)-DP (Dwork & Roth 2014, Thm 3.16), adaptively too: a later prior may depend on
  earlier outputs.

The run's label-DP ε is therefore the largest per-example sum. Everything recorded is pure ε-DP
(δ = 0); nothing else can be recorded here, so nothing is ever accounted as something it is not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting.events import ComposedEvent, PureDpEvent
from dpfy.train.budget_exhausted import BudgetExhausted

__all__ = ["LABEL_MECHANISMS", "LabelBudgetExhausted", "LabelLedger", "LabelRelease"]

#: The label randomisers this ledger accounts, each ε-label-DP per label it touches.
LABEL_MECHANISMS = ("rr", "rr-prior")

#: Relative slack on the budget check, so ε/2 + ε/2 is never refused for rounding.
_BUDGET_SLACK = 1e-12


class LabelBudgetExhausted(BudgetExhausted):
    """A release would randomise a label past the target ε; nothing was released.

    ``spent`` is the run's label-DP ε so far (the largest per-label sum), ``epsilon`` the refused
    release's and ``after`` the ε it would have brought a label to; ``delta`` is 0, as every
    release here is pure ε-label-DP.
    """

    def __init__(self, spent: float, target: float, epsilon: float, after: float) -> None:
        self._refuse(
            spent,
            target,
            0.0,
            f"label budget exhausted: randomising these labels at ε = {epsilon:g} would bring "
            f"a label to ε = {after:.6g}, past the target ε = {target:g}. "
            "Nothing was released. Randomise each label once (disjoint stages), or lower "
            "each release's ε.",
        )


@dataclass(frozen=True)
class LabelRelease:
    """One randomisation of a set of labels: its stage, mechanism, ε and how many labels."""

    stage: int
    mechanism: str
    epsilon: float
    labels: int


class LabelLedger:
    """Per-example label-DP accounting over ``dataset_size`` examples, with a budget guard.

    ``target_epsilon`` (optional) arms the guard: :meth:`check_release` refuses a release that
    would take any example's label past it, before anything is randomised.
    """

    def __init__(self, dataset_size: int, *, target_epsilon: float | None = None) -> None:
        self.dataset_size = check_count("dataset_size", dataset_size, minimum=1)
        self.target_epsilon = (
            None if target_epsilon is None else check_positive("target_epsilon", target_epsilon)
        )
        self._spent = np.zeros(self.dataset_size)
        self._times = np.zeros(self.dataset_size, dtype=np.int64)
        self._releases: list[LabelRelease] = []
        self._members: list[np.ndarray] = []  # the examples each release touched

    def _indices(self, indices: Any) -> np.ndarray:
        """Example indices as a unique integer array inside the dataset."""
        array = np.asarray(indices)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ValueError("indices must be a flat array of integer example positions")
        array = array.astype(np.int64, copy=False)
        if array.size and (array.min() < 0 or array.max() >= self.dataset_size):
            raise ValueError(f"indices must lie in [0, {self.dataset_size})")
        if np.unique(array).size != array.size:
            raise ValueError(
                "an index repeats within one release: a label randomised twice is two releases "
                "(sequential composition); record each separately"
            )
        return array

    def check_release(self, indices: Any, epsilon: float) -> None:
        """Refuse, before it happens, a release that would take a label past the target ε."""
        array = self._indices(indices)
        epsilon = check_positive("epsilon", epsilon)
        if self.target_epsilon is None or not array.size:
            return
        after = float(self._spent[array].max()) + epsilon
        if after > self.target_epsilon * (1.0 + _BUDGET_SLACK):
            raise LabelBudgetExhausted(self.epsilon, self.target_epsilon, epsilon, after)

    def record(self, indices: Any, epsilon: float, *, mechanism: str, stage: int = 0) -> None:
        """Account one ε-label-DP randomisation of the labels at ``indices`` (guarded)."""
        if mechanism not in LABEL_MECHANISMS:
            raise ValueError(
                f"mechanism must be one of {', '.join(LABEL_MECHANISMS)} (pure ε-label-DP "
                f"randomisers); got {mechanism!r}"
            )
        array = self._indices(indices)
        release = LabelRelease(check_count("stage", stage), mechanism, epsilon, array.size)
        self.check_release(array, epsilon)
        self._spent[array] += epsilon
        self._times[array] += 1
        self._members.append(array)
        self._releases.append(release)

    @property
    def releases(self) -> tuple[LabelRelease, ...]:
        """Every release, in order."""
        return tuple(self._releases)

    @property
    def epsilon(self) -> float:
        """The label-DP ε of the run: the largest per-example sum (0 before any release)."""
        return float(self._spent.max())

    @property
    def max_times_randomised(self) -> int:
        """How often the most-randomised label was randomised (1: parallel composition only)."""
        return int(self._times.max())

    @property
    def labels_randomised(self) -> int:
        """How many examples' labels were randomised at least once."""
        return int(np.count_nonzero(self._times))

    def events(self) -> ComposedEvent:
        """The most-spent label's releases as pure-DP events, for any dpfy accountant."""
        if not self._releases:
            return ComposedEvent(())
        worst = int(np.argmax(self._spent))
        return ComposedEvent(
            tuple(
                PureDpEvent(release.epsilon)
                for release, members in zip(self._releases, self._members, strict=True)
                if np.any(members == worst)
            )
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the releases and the figures the report states."""
        return {
            "dataset_size": self.dataset_size,
            "target_epsilon": self.target_epsilon,
            "epsilon": self.epsilon,
            "max_times_randomised": self.max_times_randomised,
            "labels_randomised": self.labels_randomised,
            "releases": [asdict(r) for r in self._releases],
        }
