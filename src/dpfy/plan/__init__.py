"""Plan a private run before training: accounting, mechanisms, the privacy plan (no torch).

The names below load on first use (PEP 562), so ``import dpfy.plan.accounting`` loads only the
accountants.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PrivacyPlan": "dpfy.plan.privacy_plan",
    "PlanRequest": "dpfy.plan.resolvers",
    "make_plan": "dpfy.plan.resolvers",
    "register_resolver": "dpfy.plan.resolvers",
    "resolver_keys": "dpfy.plan.resolvers",
    "SamplingKind": "dpfy.plan.sampling",
    "SamplingRecord": "dpfy.plan.sampling",
    "group_privacy": "dpfy.plan.group_privacy",
    "MechanismResult": "dpfy.plan.mechanisms",
    "gaussian_mechanism": "dpfy.plan.mechanisms",
    "laplace_mechanism": "dpfy.plan.mechanisms",
    "exponential_mechanism": "dpfy.plan.mechanisms",
    "randomized_response": "dpfy.plan.mechanisms",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dpfy.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
