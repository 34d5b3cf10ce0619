"""A saved report's figures, recomputed from its stored ledger events and checked against it.

A saved file is evidence, not authority: a re-rendered report recomputes ε from the stored
events and never trusts a stored number. :func:`recomputed_accounting` rebuilds the ledger (with
every check it made when the steps were recorded) and recomputes every figure, refusing a stored
one it does not bear out; :func:`check_settings_against` refuses settings the ledger's steps
contradict. :func:`dpfy.report.facts.recompute_accounting` applies both to a run's facts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dpfy.report.accounting import AccountingFacts, accounting_facts
from dpfy.report.json_codec import asdict, json_restore, json_safe

if TYPE_CHECKING:
    from dpfy.plan.privacy_plan import PrivacyPlan
    from dpfy.report.clip_norms import GradNormStats
    from dpfy.report.run_parts import TrainingFacts

#: Why a stored figure is refused (said in docstrings and in every disagreement message).
RECOMPUTE_RULE = (
    "a re-rendered report recomputes ε from the stored events and never trusts a stored number"
)
# A recomputation from the same events repeats the same floating-point work, so only summation
# order in a newer numpy or scipy can move it; an edit that changes a printed figure cannot hide.
_RELATIVE_TOLERANCE = 1e-6


def recomputed_accounting(stored: AccountingFacts) -> AccountingFacts:
    """``stored`` recomputed from its ledger state and accountant; a disagreement is refused.

    The ledger is rebuilt from ``ledger_state``, and its summary, ε under the Poisson assumption
    and ε table are computed afresh at the stored δ. A stored figure that disagrees beyond
    rounding is a ValueError naming the field; otherwise the recomputation is returned.
    """
    from dpfy.train.ledger import PrivacyLedger

    try:
        ledger = PrivacyLedger.from_state_dict(stored.ledger_state)
        fresh = accounting_facts(ledger, [row.delta for row in stored.epsilon_table])
    except (ValueError, ArithmeticError) as err:  # UnsupportedEventError is a ValueError too
        raise ValueError(f"accounting.ledger_state is not a usable ledger ({err})") from None
    under = f"under the {ledger.accountant} accountant ({RECOMPUTE_RULE})"
    for where, old, new in (
        ("accounting.summary", asdict(stored.summary), asdict(fresh.summary)),
        (
            "accounting.epsilon_under_poisson_assumption",
            stored.epsilon_under_poisson_assumption,
            fresh.epsilon_under_poisson_assumption,
        ),
        (
            "accounting.epsilon_table",
            [asdict(row) for row in stored.epsilon_table],
            [asdict(row) for row in fresh.epsilon_table],
        ),
    ):
        problem = _disagreement(where, json_restore(json_safe(old)), json_restore(json_safe(new)))
        if problem is not None:
            raise ValueError(f"{problem} {under}")
    return fresh


def _disagreement(where: str, stored: Any, fresh: Any) -> str | None:
    """The first place a stored figure differs from its recomputation, said for people.

    Numbers agree within a relative tolerance (and an unbounded ε only with ∞); strings and
    flags exactly.
    """
    if isinstance(fresh, dict) and isinstance(stored, dict):
        for key in [*fresh, *(k for k in stored if k not in fresh)]:
            problem = _disagreement(
                f"{where}.{key}", stored.get(key, _ABSENT), fresh.get(key, _ABSENT)
            )
            if problem is not None:
                return problem
        return None
    if isinstance(fresh, list) and isinstance(stored, list) and len(fresh) == len(stored):
        for i, (old, new) in enumerate(zip(stored, fresh, strict=True)):
            problem = _disagreement(f"{where}[{i}]", old, new)
            if problem is not None:
                return problem
        return None
    if _number(stored) and _number(fresh):
        if _close(stored, fresh):
            return None
    elif type(stored) is type(fresh) and stored == fresh:
        return None
    if fresh is _ABSENT:
        return f"{where} is {_show(stored)} but the stored ledger events give no such figure"
    return f"{where} is {_show(stored)} but the stored ledger events give {_show(fresh)}"


_ABSENT = object()


def _number(value: Any) -> bool:
    """An int or float, not a bool (JSON keeps the two apart)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _close(a: float, b: float) -> bool:
    """Equal within the recomputation tolerance; ∞ only equals ∞ and NaN equals nothing."""
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=_RELATIVE_TOLERANCE, abs_tol=1e-12)


def _show(value: Any) -> str:
    """A stored or recomputed value in a message."""
    if value is _ABSENT:
        return "missing"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and len(value) > 3:
        return f"a list of {len(value)}"
    return f"{value!r:.80}"


def check_settings_against(
    p: PrivacyPlan, t: TrainingFacts, norms: GradNormStats | None, fresh: AccountingFacts
) -> None:
    """The settings the report prints must be the ones the ledger's steps were accounted with.

    ``p`` and ``t`` are the stored plan and training facts, ``norms`` the stored gradient-norm
    summary, ``fresh`` the recomputed accounting; a contradiction is a ValueError naming it.
    """
    state, steps = fresh.ledger_state, fresh.summary.steps
    ledger = "the stored ledger"
    pairs = [
        ("privacy.delta", p.delta, state["delta"], ledger),
        ("privacy.accountant", p.accountant, state["accountant"], ledger),
        ("privacy.target_epsilon", p.target_epsilon, state["target_epsilon"], ledger),
        ("training.steps_taken", t.steps_taken, steps, ledger),
    ]
    for i, entry in enumerate(state["entries"]):
        if "sampling" not in entry:
            continue  # a labelled release (tuning): its own event, not the run's settings
        record, at = entry["sampling"], f"accounting.ledger_state.entries[{i}]"
        pairs += [
            ("privacy.noise_multiplier", p.noise_multiplier, entry["noise_multiplier"], at),
            ("privacy.sampling_rate", p.sampling_rate, record["sampling_rate"], at),
            ("privacy.sampler", p.sampler, record["kind"], at),
            ("privacy.unit", p.unit, record.get("unit", "example"), at),
            ("privacy.dataset_size", p.dataset_size, record["dataset_size"], at),
        ]
    for where, mine, theirs, source in pairs:
        same = _close(mine, theirs) if _number(mine) and _number(theirs) else mine == theirs
        if not same:
            raise ValueError(
                f"{where} is {_show(mine)} but {source} accounted {_show(theirs)} "
                f"({RECOMPUTE_RULE})"
            )
    if norms is not None and not _close(norms.max_grad_norm, p.max_grad_norm):
        raise ValueError(  # the diagnostics state how many norms were clipped at the run's C
            f"grad_norms.max_grad_norm is {_show(norms.max_grad_norm)} but the run clipped at "
            f"privacy.max_grad_norm = {_show(p.max_grad_norm)} ({RECOMPUTE_RULE})"
        )
    if t.steps_taken:
        epochs = [t.steps_taken * p.expected_batch_size / p.dataset_size]
        epochs.append(t.steps_taken * p.sampling_rate)  # federated runs count rounds × q
        if not any(_close(t.epochs, e) for e in epochs):
            raise ValueError(
                f"training.epochs is {_show(t.epochs)} but the {t.steps_taken} steps accounted "
                f"at B/N = {p.expected_batch_size}/{p.dataset_size} make {_show(epochs[0])} "
                f"({RECOMPUTE_RULE})"
            )


__all__ = ["RECOMPUTE_RULE", "check_settings_against", "recomputed_accounting"]
