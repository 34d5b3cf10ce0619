"""dpfy: train machine-learning models with differential privacy, the whole recipe.

The top-level names load lazily, so ``import dpfy.plan.accounting`` (pure numpy/scipy) never
pulls in torch. The API reference (``docs/api.md``) documents these names and each public
package's ``__all__``.
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "make_private": "dpfy.train.builder",
    "PrivateTraining": "dpfy.train.session",
    "fix": "dpfy.train.checks",
    "check_model": "dpfy.train.checks",
    "BudgetExhausted": "dpfy.train.ledger",
    "PrivacyLedger": "dpfy.train.ledger",
    "DPOptimizer": "dpfy.train.optim",
    "NonFiniteGradientError": "dpfy.train.optim",
    "CheckSchedule": "dpfy.data.check_schedule",
    "ExamplesCoupled": "dpfy.data.coupling",
    "StateChanged": "dpfy.train.behaviour.state_watch",
    "DPDataLoader": "dpfy.data",
    "PlanComplete": "dpfy.data",
    "rest_of_run": "dpfy.data",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


__getattr__ = lazy_exports(__name__, _EXPORTS)
