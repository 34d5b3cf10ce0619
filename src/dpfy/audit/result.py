"""What one audit found: ε̂, a lower bound on the ε the code that ran really has.

An :class:`AuditResult` is plain, frozen data, so the same object is returned to a Python
caller, stored in the run's facts (``report.json``, the report card) and compared with the ε the
run claims. It refuses impossible values on construction — a confidence outside (0, 1), more
correct guesses than guesses, a negative or unbounded ε̂ — because a saved audit is evidence a
person reads, and a hand-edited file must not print an audit that cannot have happened.

ε̂ ≤ claimed ε is evidence that the run is correct, never proof, and only about the code the
audit exercised: each result names its scope (:data:`dpfy.audit.scope.SCOPES`) and carries the
run's behaviour checks from training as the audit read them. ε̂ > claimed ε (at a confidence the
user chose) means the code leaks more than its accounting says: a bug.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dpfy._validate import check_count, check_finite, check_range
from dpfy.audit.scope import BehaviourChecks, check_behaviour_checks, scope_of

#: How ε̂ was obtained; the report words each one.
METHODS = {
    "one-run": (
        "one training run; each canary included independently with probability ½, the "
        "auditor's guesses scored by the one-run theorem (Steinke, Nasr & Jagielski 2023)"
    ),
    "one-run-f-dp": (
        "one training run; each canary included independently with probability ½, the "
        "auditor's guesses tested against a family of tradeoff curves (Mahloujifar, Melis & "
        "Chaudhuri 2024)"
    ),
    "f-dp": (
        "canaries in and out of repeated private steps, each step (and each canary's "
        "coordinate) a trial; the tradeoff curve of the claimed (subsampled) Gaussian fitted to "
        "Clopper–Pearson bounds on the test's rates (Nasr et al. 2023; Dong, Roth & Su 2022)"
    ),
    "classical": (
        "repeated runs with and without the canary; Clopper–Pearson bounds on the attack's "
        "false-positive and false-negative rates"
    ),
    "membership-inference": (
        "a membership-inference attack on the final model; Clopper–Pearson bounds on its "
        "false-positive and false-negative rates, each example treated as an independent trial"
    ),
}

#: What the auditor could see.
THREAT_MODELS = {
    "white-box": "every intermediate update (gradient canaries inserted into the private step)",
    "black-box": "the final model only",
}


@dataclass(frozen=True)
class AuditResult:
    """One audit: ε̂ (a lower bound at ``confidence``), how it was obtained, and at what cost.

    ``guesses`` and ``correct`` are the attack's decisions and how many were right (for the
    classical route: every classified run or example, and the true positives plus negatives);
    ``canaries`` is how many canaries the audit used, ``runs`` how many training runs;
    ``claimed_epsilon`` is the ε the run claims at the same ``delta`` (None if not known).
    ``scope`` names what the audit exercised (:data:`~dpfy.audit.scope.SCOPES`; None: the
    threat model's usual scope, see :attr:`audited_scope`); ``behaviour_checks`` are the run's
    behaviour checks from training as the audit read them from ``facts.json`` (None: not
    recorded).
    """

    method: str
    epsilon_lower_bound: float
    confidence: float
    delta: float
    canaries: int = 0
    runs: int = 1
    guesses: int = 0
    correct: int = 0
    seconds: float = 0.0
    claimed_epsilon: float | None = None
    threat_model: str = "black-box"
    notes: tuple[str, ...] = ()
    scope: str | None = None
    behaviour_checks: BehaviourChecks | None = None

    def __post_init__(self) -> None:
        _check(self)

    @property
    def exceeds_claim(self) -> bool:
        """True when the audit found more leakage than the run claims: a bug, not noise."""
        return self.claimed_epsilon is not None and self.epsilon_lower_bound > self.claimed_epsilon

    @property
    def audited_scope(self) -> str:
        """The scope this audit names, or its threat model's: a white-box audit runs the private
        step on a canary model, a black-box one attacks the model it is handed."""
        if self.scope is not None:
            return self.scope
        return "private-step" if self.threat_model == "white-box" else "trained-model"

    def with_context(self, **changes: Any) -> AuditResult:
        """The same bound with the run's context filled in (claimed ε, runs, seconds, notes)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (notes as a list)."""
        data = dataclasses.asdict(self)
        data["notes"] = list(self.notes)
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "audit") -> AuditResult:
        """Inverse of :meth:`to_dict`; a problem is one ValueError naming the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown AuditResult fields at {where}: {unknown}")
        missing = sorted({"method", "epsilon_lower_bound", "confidence", "delta"} - set(data))
        if missing:
            raise ValueError(f"malformed AuditResult at {where}: missing field(s) {missing}")
        values = dict(data)
        notes = values.get("notes", [])
        if not isinstance(notes, (list, tuple)) or not all(isinstance(n, str) for n in notes):
            raise ValueError(f"{where}.notes must be a list of strings, got {notes!r:.60}")
        values["notes"] = tuple(notes)
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"malformed AuditResult at {where}: {err}") from None


#: The name the bounds return; the same object the report carries.
AuditBound = AuditResult


def _check(result: AuditResult) -> None:
    """Refuse an audit that cannot have happened, naming the field and what it must be."""
    if result.method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {result.method!r}")
    if result.threat_model not in THREAT_MODELS:
        raise ValueError(
            f"threat_model must be one of {sorted(THREAT_MODELS)}, got {result.threat_model!r}"
        )
    if result.scope is not None:
        scope_of(result.scope)
    if result.behaviour_checks is not None:
        check_behaviour_checks(result.behaviour_checks)
    _check_number("epsilon_lower_bound", result.epsilon_lower_bound)
    if result.epsilon_lower_bound < 0:
        raise ValueError(
            f"epsilon_lower_bound must be ≥ 0 (no audit bounds ε below 0), "
            f"got {result.epsilon_lower_bound!r}"
        )
    _check_number("confidence", result.confidence)
    check_range("confidence", result.confidence, 0.0, 1.0)
    _check_number("delta", result.delta)
    check_range("delta", result.delta, 0.0, 1.0, low_open=False)
    for name in ("canaries", "guesses", "correct"):
        _check_int(name, getattr(result, name), 0)
    _check_int("runs", result.runs, 1)
    if result.correct > result.guesses:
        raise ValueError(
            f"correct ({result.correct}) cannot exceed guesses ({result.guesses}); "
            "count each right guess once"
        )
    _check_number("seconds", result.seconds)
    if result.seconds < 0:
        raise ValueError(f"seconds must be ≥ 0, got {result.seconds!r}")
    if result.claimed_epsilon is not None:
        _check_number("claimed_epsilon", result.claimed_epsilon)
        if result.claimed_epsilon <= 0:
            raise ValueError(f"claimed_epsilon must be > 0, got {result.claimed_epsilon!r}")


def _check_number(name: str, value: Any) -> None:
    """A finite real number, not a bool or a string (a JSON file may hold either)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r:.60}")
    check_finite(name, value)


def _check_int(name: str, value: Any, minimum: int) -> None:
    """A whole count (a JSON float such as 3.0 is refused, as the facts refuse it)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r:.60}")
    check_count(name, value, minimum=minimum)


__all__ = ["METHODS", "THREAT_MODELS", "AuditBound", "AuditResult"]
