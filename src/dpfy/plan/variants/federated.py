"""DP-FedAvg and DP-FedSGD (guide alg. 2; McMahan et al. 2018): user-level DP-SGD's plan.

Each round is one step: Poisson-sampled users, each user's model change clipped as one unit,
trained by :mod:`dpfy.federated` (not by make_private).
"""

from __future__ import annotations

import dataclasses

from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.variants.dp_sgd import resolve_user_dp_sgd
from dpfy.plan.variants.registry import Resolver, TrainingVariant, register_variant
from dpfy.plan.variants.request import PlanRequest
from dpfy.plan.variants.text import AlgorithmText, UserLevelText, gaussian_accounting


def _resolver(algorithm: str) -> Resolver:
    """User-level DP-SGD's plan under this algorithm's name."""

    def resolve(request: PlanRequest) -> PrivacyPlan:
        return dataclasses.replace(resolve_user_dp_sgd(request), algorithm=algorithm)

    resolve.__doc__ = f"{algorithm}: Poisson-sampled users, each user's model change clipped."
    return resolve


def _text(name: str) -> AlgorithmText:
    """The server is the trusted curator and each round is one noised average."""
    return AlgorithmText(
        name=name,
        curator=(
            "a trusted aggregator: the server sees each sampled user's model change in the "
            "clear, and only the noised global models are protected"
        ),
        guide="guide §3.1–§3.2, §4.4",
        released_from="the noised averages of clipped user model changes",
        steps="noised rounds",
        accounting=gaussian_accounting("user model changes"),
        clipped="model-change",
    )


for _algorithm, _name in (("dp-fedavg", "DP-FedAvg"), ("dp-fedsgd", "DP-FedSGD")):
    register_variant(
        TrainingVariant(
            _algorithm,
            "user",
            _name,
            _resolver(_algorithm),
            _text(_name),
            user_text=UserLevelText(
                "model change after local training",
                "each round samples users with probability q = {q:.6g}, each sampled user "
                "trains locally on their own examples, and their whole model change is clipped "
                f"to C as one unit ({_name}, guide alg. 2, McMahan et al. 2018).",
            ),
        )
    )
