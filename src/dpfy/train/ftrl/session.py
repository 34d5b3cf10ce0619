"""``make_private_ftrl``: a private DP-FTRL run, returned as the same :class:`PrivateTraining`.

What differs from DP-SGD (guide §4.3, tab. 3; Kairouz et al. 2021): batches are taken in order
(shuffled or fixed) with no sampling assumption; the noise is tree aggregation over the prefix
sums of clipped gradient sums; the run is accounted under zero-out adjacency (an example is
replaced by a null one, keeping the stream's order) as one Gaussian per tree node that can hold an
example's gradient; and σ for a target ε is calibrated on exactly those events.
``dpfy.make_private(..., algorithm="dp-ftrl")`` lands here with the default tree settings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dpfy._validate import check_count, check_positive
from dpfy.data.loader import DPDataLoader, checked_loader_options, dataset_size_of
from dpfy.data.ordered_sampling import OrderedSampler, parse_order
from dpfy.data.sampling import check_batch_size
from dpfy.plan.accounting.events import NeighbouringRelation
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind
from dpfy.plan.tree_events import ftrl_step_events, resolve_restart
from dpfy.train.ftrl.optim import DPFTRLOptimizer, check_sgd
from dpfy.train.grads import EngineChoice, LossReduction, make_engine
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.optim import BatchBoundary, NoiseSettings
from dpfy.train.session import (
    PrivateTraining,
    check_common,
    noise_source,
    resolve_sigma,
    seeded_generator,
    warn_if_delta_too_large,
    with_virtual_batches,
)

ALGORITHM = "dp-ftrl"
#: Tree aggregation keeps the stream's order: an example is replaced by a null one (App. D).
RELATION = NeighbouringRelation.ZERO_OUT


def make_private_ftrl(
    model: nn.Module,
    optimizer: torch.optim.SGD,
    train_dataset: Dataset,
    *,
    batch_size: int,
    delta: float,
    max_grad_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    sampler: SamplingKind | str | None = "shuffle",
    restart_every: int | str | None = "epoch",
    tree: str = "efficient",
    loss_reduction: LossReduction = "mean",
    engine: EngineChoice = "auto",
    accountant: str = "pld",
    microbatch_size: int | None = None,
    max_physical_batch_size: int | None = None,
    secure_noise: bool = False,
    seed: int | None = None,
    batch_first: bool = True,
    loader_options: dict[str, Any] | None = None,
) -> PrivateTraining:
    """Make ``model`` + an SGD ``optimizer`` train with DP-FTRL on ``train_dataset``.

    ``batch_size`` B is fixed; an epoch is N // B steps (``epochs=E`` gives ⌈E·(N//B)⌉ steps).
    ``sampler``: "shuffle" (a fresh permutation per epoch) or "fixed-order". ``restart_every``:
    "epoch" or a divisor of N // B. ``tree``: "efficient" (Honaker) or "plain". Give exactly one
    of ``target_epsilon`` (σ is calibrated and the budget guard stops there) and
    ``noise_multiplier``.
    """
    delta, max_grad_norm = check_common(model, optimizer, delta, max_grad_norm)
    dataset_size = dataset_size_of(train_dataset)
    batch_size = check_batch_size(dataset_size, batch_size)
    kind = parse_order(sampler)
    check_sgd(optimizer)
    per_epoch = dataset_size // batch_size
    k = resolve_restart(restart_every, per_epoch)
    total_steps = _ftrl_steps(epochs, steps, per_epoch)
    warn_if_delta_too_large(delta, dataset_size)
    sigma = _sigma(target_epsilon, noise_multiplier, delta, total_steps, per_epoch, k, accountant)
    generator = seeded_generator(seed, secure_noise)
    order = OrderedSampler(
        dataset_size,
        batch_size,
        total_steps,
        generator,
        shuffle=kind is SamplingKind.TREE_SHUFFLE,
        secure=secure_noise,
    )
    loader = DPDataLoader(
        train_dataset,
        batch_size,
        steps=total_steps,
        sampler=order,
        generator=generator,
        secure=secure_noise,
        microbatch_size=microbatch_size,
        **checked_loader_options(loader_options),
    )
    ledger = PrivacyLedger(
        delta, accountant=accountant, target_epsilon=target_epsilon, relation=RELATION
    )
    grad_engine = make_engine(model, engine, batch_first=batch_first)
    settings = NoiseSettings(sigma, max_grad_norm, batch_size, microbatch_size)
    noise = noise_source(secure_noise, None if seed is None else seed + 1)
    boundary = BatchBoundary()
    private_optimizer = DPFTRLOptimizer(
        optimizer,
        grad_engine,
        ledger,
        loader.sampling_record,
        settings,
        restart_every=k,
        tree=tree,
        provenance=loader.provenance,
        loss_reduction=loss_reduction,
        noise=noise,
        boundary=boundary,
    )
    run_loader = with_virtual_batches(loader, max_physical_batch_size, boundary)
    privacy = PrivacyPlan(
        dataset_size=dataset_size,
        expected_batch_size=batch_size,
        sampling_rate=loader.sampling_record.sampling_rate,
        steps=total_steps,
        noise_multiplier=sigma,
        max_grad_norm=max_grad_norm,
        delta=delta,
        target_epsilon=target_epsilon,
        accountant=accountant,
        sampler=kind.value,
        microbatch_size=microbatch_size,
        loss_reduction=loss_reduction,
        algorithm="dp-ftrl",
        seeded=seed is not None,
    )
    return PrivateTraining(
        model, private_optimizer, run_loader, ledger, grad_engine, privacy, noise
    )


def _ftrl_steps(epochs: float | None, steps: int | None, per_epoch: int) -> int:
    """Total steps from exactly one of epochs (⌈E·(N//B)⌉: an epoch is N//B batches) and steps."""
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs= or steps=")
    if steps is not None:
        return check_count("steps", steps, minimum=1)
    return max(1, math.ceil(check_positive("epochs", epochs) * per_epoch))


def _sigma(
    target_epsilon: float | None,
    noise_multiplier: float | None,
    delta: float,
    steps: int,
    per_epoch: int,
    restart_every: int,
    accountant: str,
) -> float:
    """σ as given, or the smallest σ whose tree events (as the ledger will compose them) fit."""
    return resolve_sigma(
        target_epsilon,
        noise_multiplier,
        delta,
        lambda sigma: ftrl_step_events(sigma, steps, per_epoch, restart_every),
        accountant,
        RELATION,
    )


_NOT_FOR_FTRL = ("distributed", "user_ids", "max_examples_per_user")


def from_make_private(arguments: dict[str, Any]) -> PrivateTraining:
    """``make_private(..., algorithm="dp-ftrl")``: its arguments, checked, to make_private_ftrl."""
    unsupported = [
        name
        for name in _NOT_FOR_FTRL
        if arguments.get(name) is not None and not (name == "distributed" and not arguments[name])
    ]  # distributed=False (one run per rank, each accounted on its own) is fine
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)} not supported with algorithm='dp-ftrl' (dpfy's DP-FTRL is "
            "example-level, in one process); leave them at their defaults"
        )
    skip = ("algorithm", *_NOT_FOR_FTRL)
    kwargs = {k: v for k, v in arguments.items() if k not in skip}
    if kwargs.get("sampler") is None:
        kwargs["sampler"] = "shuffle"
    return make_private_ftrl(**kwargs)
