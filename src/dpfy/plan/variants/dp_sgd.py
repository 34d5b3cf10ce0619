"""DP-SGD (guide alg. 1; Abadi et al. 2016) per example, and per user (McMahan et al. 2018).

Poisson sampling unless another sampler is chosen (truncated Poisson: padded to a static batch
shape, the cut charged in δ; shuffle: accounted as Poisson with the assumption flagged;
balls-in-bins: each epoch charged as random allocation, 1 of k steps; fixed-size: replace-one
adjacency, RDP), independent Gaussian noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dpfy._validate import check_count
from dpfy.plan.accounting.accountant import make_accountant
from dpfy.plan.accounting.events import NeighbouringRelation, SelfComposedEvent
from dpfy.plan.accounting.truncation import max_batch_size_for, truncation_probability
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
    if kind not in DP_SGD_SAMPLINGS:
        raise ValueError(
            f"DP-SGD samples by {', '.join(repr(k.value) for k in DP_SGD_SAMPLINGS)}, got "
            f"{kind.value!r} (the tree orders belong to algorithm='dp-ftrl')"
        )
    if request.microbatch_size is not None:
        check_count("microbatch_size", request.microbatch_size, minimum=1)
    relation, accountant = NeighbouringRelation.ADD_OR_REMOVE, request.accountant
    if kind is SamplingKind.FIXED_SIZE:  # its sound bounds hold under replace-one only
        relation, accountant = NeighbouringRelation.REPLACE_ONE, "rdp"
    record = DP_SGD_SAMPLINGS[kind](request, kind)
    steps = total_steps(request, request.records / request.batch_size)
    # Refused here, not at the first step: e.g. the RDP accountant has no balls-in-bins bound.
    reason = make_accountant(accountant, relation).unsupported_reason(record.run_event(1.0, steps))
    if reason is not None:
        raise ValueError(f"sampler={kind.value!r} with accountant={accountant!r}: {reason}")
    sigma = calibrated(request, lambda s: record.run_event(s, steps), relation, accountant)
    return plan_from(request, record, steps, sigma, relation, accountant)


def _plain_record(request: PlanRequest, kind: SamplingKind) -> SamplingRecord:
    """Poisson (no fixed size); shuffled, balls-in-bins or fixed-size batches of B."""
    return SamplingRecord(
        kind,
        request.batch_size / request.records,
        request.records,
        None if kind is SamplingKind.POISSON else request.batch_size,
    )


def _truncated_record(request: PlanRequest, kind: SamplingKind) -> SamplingRecord:
    """Poisson batches cut to and padded to M: refused where the cut would spend the budget."""
    refuse_unsupported(
        request,
        "sampler='truncated-poisson' (padded rows are masked per example)",
        microbatch_size=request.microbatch_size,
    )
    if request.accountant != "pld":
        raise ValueError(
            "sampler='truncated-poisson' is accounted with the PLD accountant (the chance a "
            "batch is cut is charged in δ beside its curve); pass accountant='pld'"
        )
    if request.max_batch_size is None:
        raise ValueError(
            "sampler='truncated-poisson' needs max_batch_size=M, the rows of every padded batch "
            f"(M = {suggested_max_batch_size(request)} keeps the cost of cutting batches below "
            "δ/100)"
        )
    cap = check_count("max_batch_size", request.max_batch_size, minimum=1)
    if cap < request.batch_size or cap > request.records:
        raise ValueError(
            f"max_batch_size {cap} must lie between the expected batch size {request.batch_size} "
            f"and the dataset size {request.records}; try {suggested_max_batch_size(request)}"
        )
    rate = request.batch_size / request.records
    steps = total_steps(request, request.records / request.batch_size)
    spent = (
        (1 + math.exp(_epsilon_scale(request)))
        * steps
        * truncation_probability(request.records, rate, cap)
    )
    if spent > request.delta / 2:
        raise ValueError(
            f"max_batch_size {cap} cuts a batch too often: over {steps} steps the cut would "
            f"spend {spent:.3g} of δ = {request.delta:g}; raise max_batch_size to at least "
            f"{suggested_max_batch_size(request)}"
        )
    return SamplingRecord(kind, rate, request.records, cap)


def _epsilon_scale(request: PlanRequest) -> float:
    """The ε the cut's (1 + e^ε) factor is judged at: the target, or 10 when σ is given."""
    return min(request.target_epsilon or 10.0, 50.0)


def suggested_max_batch_size(request: PlanRequest) -> int:
    """The smallest M whose cut spends at most δ/100 of the run's δ (at the target ε)."""
    steps = total_steps(request, request.records / request.batch_size)
    budget = request.delta / 100 / (1 + math.exp(_epsilon_scale(request)))
    return max_batch_size_for(request.records, request.batch_size / request.records, steps, budget)


#: The batch selections DP-SGD takes, each with the record its sampler must report.
DP_SGD_SAMPLINGS: dict[SamplingKind, Callable[[PlanRequest, SamplingKind], SamplingRecord]] = {
    SamplingKind.POISSON: _plain_record,
    SamplingKind.TRUNCATED_POISSON: _truncated_record,
    SamplingKind.BALLS_IN_BINS: _plain_record,
    SamplingKind.SHUFFLE: _plain_record,
    SamplingKind.FIXED_SIZE: _plain_record,
}


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
