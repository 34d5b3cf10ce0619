"""Plan a private run before training: accounting, mechanisms, the privacy plan (no torch).

The names below load on first use (PEP 562), so ``import dpfy.plan.accounting`` loads only the
accountants.
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports

_EXPORTS = {
    "PrivacyPlan": "dpfy.plan.privacy_plan",
    "PlanRequest": "dpfy.plan.variants",
    "TrainingVariant": "dpfy.plan.variants",
    "make_plan": "dpfy.plan.variants",
    "register_variant": "dpfy.plan.variants",
    "variant_for": "dpfy.plan.variants",
    "variant_keys": "dpfy.plan.variants",
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
