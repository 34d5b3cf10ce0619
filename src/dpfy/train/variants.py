"""What each (algorithm, sampling unit) needs from torch: its records, its loader, its reach.

The plan side of a variant is its registered :class:`~dpfy.plan.variants.TrainingVariant`; the
training side is built here from what it names: how the sampled records are counted, which
loader draws them, and whether it runs across ranks. The builder (:mod:`dpfy.train.builder`)
looks both up; nothing downstream branches on the variant's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from dpfy._validate import check_count
from dpfy.data.cyclic_sampling import CyclicPoissonSampler
from dpfy.data.loader import DPDataLoader, dataset_size_of
from dpfy.data.ordered_sampling import OrderedSampler, RepeatedOrderSampler
from dpfy.data.sampling import DpBatchSampler, check_batch_size, epoch_length
from dpfy.data.user_sampling import UserDataLoader, check_user_ids, user_sampling_rate
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind
from dpfy.plan.variants import variant_for as plan_variant
from dpfy.train.distributed import ProcessGroupReplicas, SingleProcess

__all__ = ["LoaderInputs", "Records", "Variant", "variant_for"]


@dataclass(frozen=True)
class Records:
    """What is sampled: N records (examples or users), B of them expected per step, and for
    users, whose example is whose."""

    count: int
    batch_size: int
    examples: int
    user_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class LoaderInputs:
    """Everything a variant's loader is built from besides the plan."""

    dataset: Dataset
    records: Records
    generator: torch.Generator | None
    secure: bool
    replicas: SingleProcess | ProcessGroupReplicas
    options: dict[str, Any]


@dataclass(frozen=True)
class Variant:
    """The training side of one (algorithm, unit): records, loader, and whether it spans ranks."""

    unit: str
    count: Callable[[Dataset, torch.Tensor | None, int], Records]
    loader: Callable[[PrivacyPlan, LoaderInputs], DPDataLoader]
    distributed: bool = False  # False: one process only (refused under a process group)
    virtual_batches: bool = True


def _examples(dataset: Dataset, user_ids: torch.Tensor | None, batch_size: int) -> Records:
    """N examples; B must lie in [1, N]."""
    size = dataset_size_of(dataset)
    return Records(size, check_batch_size(size, batch_size), size)


def _users(dataset: Dataset, user_ids: torch.Tensor | None, batch_size: int) -> Records:
    """N users from one user id per example; B (users per step) must lie in [1, N_users]."""
    ids = check_user_ids(user_ids, dataset_size_of(dataset))
    count = int(ids.max()) + 1
    user_sampling_rate(count, batch_size)  # refuses B_users outside [1, N_users] with the fix
    return Records(count, check_count("batch_size", batch_size, minimum=1), int(ids.numel()), ids)


def _sampled_loader(plan: PrivacyPlan, inputs: LoaderInputs) -> DPDataLoader:
    """DP-SGD's loader: Poisson, shuffled or fixed-size batches (each rank's shard if several)."""
    sampler = inputs.replicas.sampler(
        SamplingKind.parse(plan.sampler),
        plan.dataset_size,
        plan.expected_batch_size,
        plan.steps,
        inputs.generator,
        secure=inputs.secure,
        max_batch_size=plan.max_batch_size,  # truncated Poisson's static batch shape
    )
    return _example_loader(plan, inputs, sampler)


def _example_loader(
    plan: PrivacyPlan, inputs: LoaderInputs, sampler: DpBatchSampler
) -> DPDataLoader:
    """The private loader over examples, drawing the plan's steps from ``sampler``, by epochs."""
    return DPDataLoader(
        inputs.dataset,
        plan.expected_batch_size,
        sampler=sampler,
        generator=inputs.generator,
        secure=inputs.secure,
        microbatch_size=plan.microbatch_size,
        **inputs.options,
    )


def _user_loader(plan: PrivacyPlan, inputs: LoaderInputs) -> DPDataLoader:
    """User-level DP-SGD's loader: Poisson-sampled users, each bringing (a cap of) their data."""
    assert inputs.records.user_ids is not None  # counted by _users
    return UserDataLoader(
        inputs.dataset,
        inputs.records.user_ids,
        plan.expected_batch_size,
        steps=plan.steps,
        max_examples_per_user=plan.max_examples_per_user,
        generator=inputs.generator,
        secure=inputs.secure,
        **inputs.options,
    )


def _ordered_loader(plan: PrivacyPlan, inputs: LoaderInputs) -> DPDataLoader:
    """DP-FTRL's loader: each epoch's batches in shuffled or fixed order, no sampling assumed."""
    order = OrderedSampler(
        plan.dataset_size,
        plan.expected_batch_size,
        generator=inputs.generator,
        shuffle=SamplingKind.parse(plan.sampler) is SamplingKind.TREE_SHUFFLE,
        secure=inputs.secure,
        total=plan.steps,
    )
    return _example_loader(plan, inputs, order)


def _factorised_loader(plan: PrivacyPlan, inputs: LoaderInputs) -> DPDataLoader:
    """BandMF's and BLT's loader: one order drawn before training, the same every epoch; or,
    for amplified BandMF, cyclic Poisson groups (as many as the strategy's bands)."""
    sampler: DpBatchSampler
    if SamplingKind.parse(plan.sampler) is SamplingKind.CYCLIC_POISSON:
        sampler = CyclicPoissonSampler(
            plan.dataset_size,
            len(plan.strategy or ()),
            plan.sampling_rate,
            epoch_length(plan.dataset_size, plan.expected_batch_size),
            inputs.generator,
            secure=inputs.secure,
            total=plan.steps,
        )
    else:
        sampler = RepeatedOrderSampler(
            plan.dataset_size,
            plan.expected_batch_size,
            generator=inputs.generator,
            secure=inputs.secure,
            total=plan.steps,
        )
    return _example_loader(plan, inputs, sampler)


#: The loaders by the batch selection a plan-side variant names (its ``batches``).
BATCH_SELECTIONS: dict[str, Callable[[PrivacyPlan, LoaderInputs], DPDataLoader]] = {
    "sampled": _sampled_loader,
    "users": _user_loader,
    "ordered": _ordered_loader,
    "factorised": _factorised_loader,
}
#: How the sampled records are counted, by unit.
_COUNTS = {"example": _examples, "user": _users}


def variant_for(algorithm: str, unit: str) -> Variant:
    """The training side of (``algorithm``, ``unit``), from its registered variant."""
    spec = plan_variant(algorithm, unit)  # refuses an unknown pair, naming the choices
    if spec.batches is None:
        raise ValueError(  # the federated algorithms: a round is local training, not a step
            f"{spec.algorithm} per {unit} is not trained by make_private; use dpfy.federated"
        )
    return Variant(
        unit,
        _COUNTS[unit],
        BATCH_SELECTIONS[spec.batches],
        distributed=spec.distributed,
        virtual_batches=spec.virtual_batches,
    )
