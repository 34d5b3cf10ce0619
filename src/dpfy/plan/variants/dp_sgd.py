"""DP-SGD (guide alg. 1; Abadi et al. 2016) per example, and per user (McMahan et al. 2018).

Poisson sampling unless another sampler is chosen (shuffle: accounted as Poisson with the
assumption flagged; fixed-size: replace-one adjacency, RDP), independent Gaussian noise.
"""

from __future__ import annotations

from dpfy._validate import check_count
from dpfy.plan.accounting.events import NeighbouringRelation, SelfComposedEvent
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.plan.variants.registry import TrainingVariant, register_variant
from dpfy.plan.variants.request import (
    PlanRequest,
    calibrated,
    plan_from,
    refuse_unsupported,
    total_steps,
)
from dpfy.plan.variants.text import (
    UserLevelText,
    central_gradients,
    gaussian_accounting,
)

__all__ = ["DP_SGD_TEXT", "resolve_dp_sgd", "resolve_user_dp_sgd"]


def resolve_dp_sgd(request: PlanRequest) -> PrivacyPlan:
    """DP-SGD (guide alg. 1): Poisson unless another sampler is chosen (fixed-size: replace-one)."""
    refuse_unsupported(
        request,
        "DP-SGD",
        restart_every=request.restart_every,
        tree=request.tree,
        bands=request.bands,
        buffers=request.buffers,
    )
    kind = SamplingKind.parse(SamplingKind.POISSON if request.sampler is None else request.sampler)
    if kind not in (SamplingKind.POISSON, SamplingKind.SHUFFLE, SamplingKind.FIXED_SIZE):
        raise ValueError(
            f"DP-SGD samples by 'poisson', 'shuffle' or 'fixed-size', got {kind.value!r} (the "
            "tree orders belong to algorithm='dp-ftrl')"
        )
    if request.microbatch_size is not None:
        check_count("microbatch_size", request.microbatch_size, minimum=1)
    relation, accountant = NeighbouringRelation.ADD_OR_REMOVE, request.accountant
    if kind is SamplingKind.FIXED_SIZE:  # its sound bounds hold under replace-one only
        relation, accountant = NeighbouringRelation.REPLACE_ONE, "rdp"
    record = SamplingRecord(
        kind,
        request.batch_size / request.records,
        request.records,
        None if kind is SamplingKind.POISSON else request.batch_size,
    )
    steps = total_steps(request, request.records / request.batch_size)
    sigma = calibrated(
        request, lambda s: SelfComposedEvent(record.event(s), steps), relation, accountant
    )
    return plan_from(request, record, steps, sigma, relation, accountant)


def resolve_user_dp_sgd(request: PlanRequest) -> PrivacyPlan:
    """User-level DP-SGD (McMahan et al. 2018): Poisson-sampled users, each user's mean clipped."""
    poisson = request.sampler is None or SamplingKind.parse(request.sampler) is SamplingKind.POISSON
    refuse_unsupported(
        request,
        "user_ids (user-level DP-SGD samples users by Poisson and clips per user)",
        microbatch_size=request.microbatch_size,
        sampler=None if poisson else request.sampler,
        restart_every=request.restart_every,
        tree=request.tree,
        bands=request.bands,
        buffers=request.buffers,
    )
    cap = request.max_examples_per_user
    if cap is not None:
        cap = check_count("max_examples_per_user", cap, minimum=1)
    relation = NeighbouringRelation.ADD_OR_REMOVE
    record = SamplingRecord(
        SamplingKind.POISSON, request.batch_size / request.records, request.records, unit="user"
    )
    steps = total_steps(request, request.records / request.batch_size)
    sigma = calibrated(
        request, lambda s: SelfComposedEvent(record.event(s), steps), relation, request.accountant
    )
    return plan_from(
        request,
        record,
        steps,
        sigma,
        relation,
        request.accountant,
        unit="user",
        examples=request.examples,
        max_examples_per_user=cap,
    )


DP_SGD_TEXT = central_gradients("DP-SGD", gaussian_accounting("gradients"))

register_variant(
    TrainingVariant(
        "dp-sgd", "example", "DP-SGD", resolve_dp_sgd, DP_SGD_TEXT, "sampled", distributed=True
    )
)
register_variant(
    TrainingVariant(
        "dp-sgd",
        "user",
        "DP-SGD",
        resolve_user_dp_sgd,
        DP_SGD_TEXT,
        "users",
        virtual_batches=False,
        user_text=UserLevelText(
            "mean gradient",
            "each step samples users (not examples) with probability q = {q:.6g}, and each "
            "sampled user's gradient is the mean over {used}, clipped to C as one unit "
            "(user-level DP-SGD, McMahan et al. 2018).",
        ),
    )
)
