"""DP-FTRL (Kairouz et al. 2021): batches in order, tree-aggregated noise, zero-out relation."""

from __future__ import annotations

from dpfy.plan.accounting.events import NeighbouringRelation
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingRecord, parse_order
from dpfy.plan.tree_events import check_tree, ftrl_step_events, resolve_restart
from dpfy.plan.variants.registry import TrainingVariant, register_variant
from dpfy.plan.variants.request import (
    PlanRequest,
    calibrated,
    plan_from,
    refuse_unsupported,
    total_steps,
)
from dpfy.plan.variants.text import (
    central_gradients,
)

__all__ = ["resolve_dp_ftrl"]


def resolve_dp_ftrl(request: PlanRequest) -> PrivacyPlan:
    """DP-FTRL (Kairouz et al. 2021): batches in order, tree-aggregated noise, zero-out relation."""
    refuse_unsupported(request, "DP-FTRL", bands=request.bands, buffers=request.buffers)
    kind = parse_order(request.sampler)
    per_epoch = request.records // request.batch_size
    k = resolve_restart(request.restart_every, per_epoch)
    tree = check_tree("efficient" if request.tree is None else str(request.tree))
    relation = NeighbouringRelation.ZERO_OUT  # the stream's order is kept (App. D)
    record = SamplingRecord(
        kind, request.batch_size / request.records, request.records, request.batch_size
    )
    steps = total_steps(request, per_epoch)
    sigma = calibrated(
        request,
        lambda s: ftrl_step_events(s, steps, per_epoch, k),
        relation,
        request.accountant,
    )
    return plan_from(
        request,
        record,
        steps,
        sigma,
        relation,
        request.accountant,
        algorithm="dp-ftrl",
        mechanism="tree-aggregation",
        restart_every=k,
        tree=tree,
    )


_TREE_ACCOUNTING = (  # Kairouz et al. 2021, App. D; dpfy.plan.tree_events
    "DP-FTRL with tree aggregation, accounted with the {accountant} accountant and NO sampling "
    "assumption: every node of the binary tree over the steps carries Gaussian noise of std "
    "σ·sensitivity (σ = {sigma:.6g}); one example's clipped gradient sits in at most "
    "⌈log₂(T+1)⌉ nodes of a tree of T steps and enters each tree at most once, so each epoch is "
    "a Gaussian mechanism of noise σ/√⌈log₂(T+1)⌉ and epochs compose. Adjacency replaces an "
    "example by a null one (the order is kept)."
)

register_variant(
    TrainingVariant(
        "dp-ftrl",
        "example",
        "DP-FTRL",
        resolve_dp_ftrl,
        central_gradients("DP-FTRL (Kairouz et al. 2021)", _TREE_ACCOUNTING),
        "ordered",
    )
)
