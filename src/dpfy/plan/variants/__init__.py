"""Training variants, each one composed object registered once (:mod:`.registry`).

Importing the package registers every variant: DP-SGD per example and per user, DP-FTRL,
BandMF and BLT, DP-FedAvg and DP-FedSGD — one module each.
"""

from __future__ import annotations

# Registration order is the order the CLI and messages list the algorithms in.
from dpfy.plan.variants import dp_sgd  # noqa: F401  (registers)

# isort: split
from dpfy.plan.variants import dp_ftrl  # noqa: F401

# isort: split
from dpfy.plan.variants import factorised, federated  # noqa: F401

# isort: split
from dpfy.plan.variants.registry import (
    Resolver,
    TrainingVariant,
    make_plan,
    register_variant,
    trained_algorithms,
    variant_for,
    variant_keys,
    variants,
)
from dpfy.plan.variants.request import PlanRequest
from dpfy.plan.variants.text import AlgorithmText, UserLevelText

__all__ = [
    "AlgorithmText",
    "PlanRequest",
    "Resolver",
    "TrainingVariant",
    "UserLevelText",
    "make_plan",
    "register_variant",
    "trained_algorithms",
    "variant_for",
    "variant_keys",
    "variants",
]
