"""What the user asked for, and the steps every variant takes from it to its privacy plan.

A variant's resolver (one module each in this package) fixes everything privacy-relevant before
the first step — steps, the sampling record the sampler must then report, the neighbouring
relation, the accountant, the noise mechanism and σ, calibrated on exactly the events the ledger
will record. What every resolver shares lives here. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting.calibrate import smallest_noise_multiplier
from dpfy.plan.accounting.events import DpEvent, NeighbouringRelation
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord

__all__ = ["PlanRequest", "calibrated", "plan_from", "refuse_unsupported", "total_steps"]


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for, already checked for type and range by the builder.

    ``records`` and ``batch_size`` count what is sampled: examples, or users at user level
    (``examples`` is then the number of examples they hold). ``sampler``, ``restart_every``,
    ``tree``, ``bands`` and ``buffers`` are None when the user left them to the algorithm.
    """

    records: int
    batch_size: int
    delta: float
    max_grad_norm: float
    epochs: float | None = None
    steps: int | None = None
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    accountant: str = "pld"
    sampler: SamplingKind | str | None = None
    microbatch_size: int | None = None
    loss_reduction: str = "mean"
    seeded: bool = False
    world_size: int = 1
    examples: int | None = None
    max_examples_per_user: int | None = None
    restart_every: int | str | None = None
    tree: str | None = None
    bands: int | None = None
    buffers: int | None = None
    #: Truncated Poisson sampling's cap M (the rows of every padded batch).
    max_batch_size: int | None = None


def calibrated(
    request: PlanRequest,
    run_events: Callable[[float], DpEvent],
    relation: NeighbouringRelation,
    accountant: str,
) -> float:
    """σ as given, or the smallest σ whose run (``run_events(σ)``) meets the target ε."""
    if (request.target_epsilon is None) == (request.noise_multiplier is None):
        raise ValueError(
            "give exactly one of target_epsilon= (σ is calibrated) or noise_multiplier="
        )
    if request.noise_multiplier is not None:
        return check_positive("noise_multiplier", request.noise_multiplier)
    return smallest_noise_multiplier(
        run_events,
        check_positive("target_epsilon", request.target_epsilon),
        request.delta,
        accountant=accountant,
        relation=relation,
    )


def total_steps(request: PlanRequest, per_epoch: float) -> int:
    """Total steps from exactly one of epochs (⌈E · steps per epoch⌉) and steps."""
    if (request.epochs is None) == (request.steps is None):
        raise ValueError("give exactly one of epochs= or steps=")
    if request.steps is not None:
        return check_count("steps", request.steps, minimum=1)
    return max(1, math.ceil(check_positive("epochs", request.epochs) * per_epoch))


def refuse_unsupported(request: PlanRequest, what: str, **unsupported: object) -> None:
    """One error naming every option this variant cannot honour (set away from its default)."""
    given = [name for name, value in unsupported.items() if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} not supported with {what}; leave "
            f"{'them' if len(given) > 1 else 'it'} at the default"
        )


def plan_from(
    request: PlanRequest,
    record: SamplingRecord,
    steps: int,
    sigma: float,
    relation: NeighbouringRelation,
    accountant: str,
    **variant: object,
) -> PrivacyPlan:
    """The plan's common fields from the request and the resolved sampling, steps and σ."""
    if request.max_batch_size is not None and record.max_batch_size is None:
        raise ValueError(
            "max_batch_size caps truncated Poisson batches: pass sampler='truncated-poisson' "
            "with it, or leave it None"
        )
    return PrivacyPlan(
        dataset_size=request.records,
        expected_batch_size=request.batch_size,
        sampling_rate=record.sampling_rate,
        steps=steps,
        noise_multiplier=sigma,
        max_grad_norm=request.max_grad_norm,
        delta=request.delta,
        target_epsilon=request.target_epsilon,
        accountant=accountant,
        sampler=record.kind.value,
        microbatch_size=request.microbatch_size,
        loss_reduction=request.loss_reduction,
        seeded=request.seeded,
        world_size=request.world_size,
        relation=relation.value,
        max_batch_size=record.max_batch_size,
        **variant,  # type: ignore[arg-type]
    )
