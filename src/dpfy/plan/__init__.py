"""Plan a private run before training: accounting, mechanisms, the privacy plan (no torch).

The names below load on first use (PEP 562), so ``import dpfy.plan.accounting`` loads only the
accountants.
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _EXPORTS)
