"""``make_private``: one call turns a model, optimizer and dataset into a private training run.

One builder for every variant: the request becomes a :class:`~dpfy.plan.privacy_plan.PrivacyPlan`
through the resolver of its training variant (:mod:`dpfy.plan.variants`), the variant's loader
draws the records the plan describes (:mod:`dpfy.train.variants`), and the same private step
(:class:`~dpfy.train.optim.DPOptimizer`) with the plan's noise mechanism trains every one of
them. It checks the model first (guide §5.5.1) and returns one :class:`PrivateTraining`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpfy._validate import check_delta, check_positive, check_seed
from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.from_dataloader import unpack_dataloader
from dpfy.data.loader import DPDataLoader, checked_loader_options
from dpfy.plan.accounting import make_accountant
from dpfy.plan.sampling import SamplingKind
from dpfy.plan.variants import PlanRequest, make_plan
from dpfy.train.behaviour.checks import BehaviourChecks
from dpfy.train.checks import check_model
from dpfy.train.distributed import (
    ProcessGroupReplicas,
    SingleProcess,
    current_replicas,
    replicas_for,
    trainable_shapes,
    unwrap_ddp,
)
from dpfy.train.grads import EngineChoice, LossReduction, make_engine
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.noise.source import NoiseSource, SecureNoise, TorchNoise
from dpfy.train.opacus_names import refuse_opacus_keywords
from dpfy.train.optim import BatchBoundary, DPOptimizer
from dpfy.train.session import PrivateTraining
from dpfy.train.variants import LoaderInputs, Variant, variant_for
from dpfy.train.virtual import VirtualBatchLoader

__all__ = [
    "check_common",
    "make_private",
    "noise_source",
    "seeded_generator",
    "warn_if_delta_too_large",
]


@refuse_opacus_keywords
def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_dataset: Dataset | DataLoader,
    *,
    batch_size: int | None = None,
    delta: float,
    max_grad_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    loss_reduction: LossReduction = "mean",
    engine: EngineChoice = "auto",
    accountant: str = "pld",
    sampler: SamplingKind | str | None = None,
    microbatch_size: int | None = None,
    max_batch_size: int | None = None,
    max_physical_batch_size: int | None = None,
    secure_noise: bool = False,
    seed: int | None = None,
    batch_first: bool = True,
    loader_options: dict[str, Any] | None = None,
    distributed: bool | None = None,
    user_ids: torch.Tensor | None = None,
    max_examples_per_user: int | None = None,
    algorithm: str = "dp-sgd",
    restart_every: int | str | None = None,
    tree: str | None = None,
    bands: int | None = None,
    buffers: int | None = None,
    criterion: Callable[..., torch.Tensor] | None = None,
    behaviour_checks: CheckSchedule | None = None,
    public_buffers: Sequence[str] = (),
) -> PrivateTraining:
    """Make ``model`` + ``optimizer`` train privately on ``train_dataset`` (guide alg. 1).

    ``batch_size`` is the *expected* batch size B (q = B/N from the dataset size).
    ``train_dataset`` may be a torch ``DataLoader``: its dataset, ``collate_fn``, workers,
    pinning and worker-seeding generator are kept, its ``batch_size`` is B (``batch_size`` may be
    omitted; both given must agree), and its sampler, ``shuffle`` and ``drop_last`` give way to
    the private sampler. Give exactly
    one of ``epochs``/``steps`` and exactly one of ``target_epsilon`` (σ is calibrated and the
    budget guard stops the run there) / ``noise_multiplier``. ``sampler`` is Poisson unless you
    explicitly choose "shuffle" (accounted under the Poisson assumption, flagged as not met) or
    "fixed-size" (replace-one adjacency, RDP accounting). ``sampler="truncated-poisson"`` with
    ``max_batch_size=M`` cuts each Poisson batch to at most M examples and pads it to exactly M
    rows (static shapes; padding rows weigh exactly 0), charging the chance of a cut in δ.
    ``seed`` makes sampling and noise
    reproducible; leave it None in production (OS-seeded). ``secure_noise`` draws noise and
    sampling from the OS CSPRNG (slower; no seed then). ``distributed`` (None: automatic when a
    process group of more than one rank is initialised) trains across ranks with one guarantee
    and one ledger: every rank passes the same whole dataset and settings.
    ``loader_options`` go to the private loader's ``DataLoader`` (``num_workers``,
    ``pin_memory``, ``collate_fn``, …; the batches stay the sampler's).

    ``user_ids`` (one user id per example, users 0..U-1) trains user-level DP-SGD (McMahan et
    al. 2018): each step samples users by Poisson at q = B/U, clips each sampled user's mean
    gradient to C, and ``batch_size``, ``epochs``, ε and δ count users;
    ``max_examples_per_user`` caps how many of a sampled user's examples one step uses.

    ``algorithm="dp-ftrl"`` trains with DP-FTRL (Kairouz et al. 2021): fixed batches of B in
    ``sampler`` "shuffle" (default) or "fixed-order" order with no sampling assumption, noise
    aggregated over a tree restarted every ``restart_every`` steps ("epoch", the default, or a
    divisor of N // B) with the ``tree`` estimator ("efficient", Honaker 2015, or "plain").

    ``algorithm="bandmf"`` or ``"blt"`` trains with matrix-factorisation noise (BandMF,
    Choquette-Choo et al. 2023 / McKenna 2024; BLT, Dvijotham, McMahan et al. 2024): fixed
    batches of B in one order drawn before training and repeated every epoch, noise
    σ·C·(C⁻¹z)_t correlated across steps so that it cancels in the running sum, from a strategy
    optimised for the run's steps and epochs when the plan is made — ``bands`` (BandMF, default
    min(16, N // B); bands − 1 noise tensors per parameter) or ``buffers`` (BLT, default 4; one
    tensor per buffer). It is accounted as one Gaussian mechanism of noise σ/Δ under zero-out
    adjacency (min-separation participation; docs/correlated-noise.md), charged epoch by epoch.
    BandMF with ``sampler="cyclic-poisson"`` is amplified BandMF: ``bands`` fixed groups (default
    min(16, ⌊(N // B)/8⌋)), each step Poisson-samples the next at q = bands·B/N, accounted as
    subsampled Gaussians under add-or-remove adjacency.

    Each example's contribution must depend on that example alone, and dpfy checks it by
    behaviour on the first batches and then on a schedule (``behaviour_checks``, a
    :class:`~dpfy.data.check_schedule.CheckSchedule`; default: the first 2 batches, then every
    50th): each probed batch's collate_fn is compared with a few examples collated alone, the
    model's outputs for a few examples with the rest of the batch replaced, and — when
    ``criterion`` (the loss, ``criterion(output, target)``) is given and the loop calls
    ``private.criterion`` — each example's loss gradient with its gradient alone. A coupling
    refuses the step before anything changes, naming its source. Every parameter and buffer is
    fingerprinted after each step: a change outside the step (a ``.data`` write in the forward
    pass, a write in the loop) refuses the next one, except in ``public_buffers`` (buffer names
    whose values are public).
    """
    model = unwrap_ddp(model)  # dpfy sums the clipped, noised gradients across ranks itself
    seed = check_seed(seed)  # a negative or fractional seed never reaches torch
    make_accountant(accountant)  # an unknown name is refused whatever the sampler picks
    train_dataset, batch_size, options = unpack_dataloader(
        train_dataset, batch_size, checked_loader_options(loader_options)
    )
    schedule = behaviour_checks if behaviour_checks is not None else CheckSchedule()
    if not isinstance(schedule, CheckSchedule):
        raise ValueError(
            "behaviour_checks must be a dpfy.CheckSchedule (e.g. CheckSchedule(first=2, "
            f"every=50)), got {type(schedule).__name__}"
        )
    options["behaviour_checks"] = schedule
    unit = "user" if user_ids is not None else "example"
    if user_ids is None and max_examples_per_user is not None:
        raise ValueError("max_examples_per_user needs user_ids (one user id per example)")
    variant = variant_for(algorithm, unit)
    replicas = _replicas(variant, algorithm, unit, distributed, model)
    if max_physical_batch_size is not None and not variant.virtual_batches:
        raise ValueError(
            f"max_physical_batch_size not supported with {algorithm} per {unit}: a user's "
            "examples are one clipping unit; leave it at the default"
        )
    delta, max_grad_norm = check_common(model, optimizer, delta, max_grad_norm)
    records = variant.count(train_dataset, user_ids, batch_size)
    warn_if_delta_too_large(delta, records.count, unit)
    plan = make_plan(
        PlanRequest(
            records=records.count,
            batch_size=records.batch_size,
            delta=delta,
            max_grad_norm=max_grad_norm,
            epochs=epochs,
            steps=steps,
            target_epsilon=target_epsilon,
            noise_multiplier=noise_multiplier,
            accountant=accountant,
            sampler=sampler,
            microbatch_size=microbatch_size,
            loss_reduction=loss_reduction,
            seeded=seed is not None,
            max_batch_size=max_batch_size,
            world_size=replicas.world_size,
            examples=records.examples if unit == "user" else None,
            max_examples_per_user=max_examples_per_user,
            restart_every=restart_every,
            tree=tree,
            bands=bands,
            buffers=buffers,
        ),
        algorithm,
        unit,
    )
    generator = seeded_generator(
        None if seed is None else replicas.sampling_seed(seed), secure_noise
    )
    loader = variant.loader(
        plan,
        LoaderInputs(
            train_dataset,
            records,
            generator,
            secure_noise,
            replicas,
            options,
        ),
    )
    ledger = PrivacyLedger(
        delta, accountant=plan.accountant, target_epsilon=target_epsilon, relation=plan.relation
    )
    grad_engine = make_engine(model, engine, batch_first=batch_first)
    noise = noise_source(secure_noise, None if seed is None else replicas.noise_seed(seed))
    boundary = BatchBoundary()
    behaviour = None
    try:  # a refused optimizer or disagreeing ranks leave the model without hooks
        behaviour = BehaviourChecks(
            grad_engine,
            schedule,
            loader.provenance.stamp,
            loss_reduction=plan.loss_reduction,
            criterion=criterion,
            public_buffers=public_buffers,
            current=lambda: loader.provenance.current,  # its padding rows are never probed
            chunk=lambda: boundary.chunk,
        )
        replicas.prepare(grad_engine, behaviour)  # sharded models: fast engine, no model rerun
        private_optimizer = DPOptimizer(
            optimizer,
            grad_engine,
            ledger,
            loader.sampling_record,
            plan,
            provenance=loader.provenance,
            noise=noise,
            boundary=boundary,
            aggregator=replicas.aggregator(),
            behaviour=behaviour,
        )
        run_loader = with_virtual_batches(loader, max_physical_batch_size, boundary)
        replicas.check_agreement({**asdict(plan), "parameters": trainable_shapes(model)})
        replicas.broadcast_model(model)
    except Exception:
        grad_engine.detach()
        if behaviour is not None:
            behaviour.detach()
        raise
    return PrivateTraining(
        model, private_optimizer, run_loader, ledger, grad_engine, plan, noise, replicas
    )


def _replicas(
    variant: Variant, algorithm: str, unit: str, distributed: bool | None, model: nn.Module
) -> SingleProcess | ProcessGroupReplicas:
    """The ranks the run spans; a one-process variant refuses to run silently on every rank.

    Each rank would train its own private model on the whole dataset, W releases no single
    ledger accounts. ``distributed=False`` says the user wants exactly that, rank by rank.
    """
    if variant.distributed:
        return replicas_for(distributed, model)
    if distributed is not False and (
        distributed or isinstance(current_replicas(), ProcessGroupReplicas)
    ):
        route = f"{algorithm} per {unit}" if unit == "user" else f"algorithm={algorithm!r}"
        raise ValueError(
            f"{route} runs in one process only, but a torch.distributed process group of more "
            "than one rank is running (or distributed=True was passed): every rank would train "
            "its own private model. Run it in a single process, or pass distributed=False if "
            "each rank should train (and account) its own run independently"
        )
    return SingleProcess()


def check_common(
    model: nn.Module, optimizer: torch.optim.Optimizer, delta: float, max_grad_norm: float
) -> tuple[float, float]:
    """Refuse what no private run can use: batch-coupled layers, a bad δ or C, a stray optimizer.

    Returns δ and C, checked.
    """
    check_model(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "the model has no trainable parameters (every requires_grad is False), so a private "
            "step would have nothing to clip or noise; unfreeze the parameters to train"
        )
    delta = check_delta(delta)
    max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
    _check_optimizer_params(model, optimizer)
    return delta, max_grad_norm


def warn_if_delta_too_large(delta: float, records: int, record: str = "example") -> None:
    """δ must be ≪ 1/N: publishing one random record outright satisfies δ = 1/N (guide §2.1)."""
    if delta >= 1 / records:
        n = "N" if record == "example" else f"N_{record}s"
        warnings.warn(
            f"δ = {delta:g} is not below 1/{n} = {1 / records:g}: a mechanism that publishes one "
            f"random {record}'s data outright would satisfy it (guide §2.1); choose δ ≪ 1/{n}",
            UserWarning,
            stacklevel=3,
        )


def seeded_generator(seed: int | None, secure: bool = False) -> torch.Generator | None:
    """The sampling generator: OS-seeded in production, seeded only for experiments.

    None with ``secure``: sampling then draws from the OS CSPRNG like the noise, since an
    adversary who can predict the batches defeats the amplification the accounting counts on.
    """
    if secure:
        if seed is not None:
            raise ValueError(
                "secure_noise=True draws sampling and noise from the OS CSPRNG, which no seed can "
                "replay; pass seed=None with secure_noise=True, or secure_noise=False to seed"
            )
        return None
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def noise_source(secure: bool, seed: int | None) -> NoiseSource:
    """The OS CSPRNG when asked, else a torch generator (OS-seeded unless ``seed`` is given)."""
    return SecureNoise() if secure else TorchNoise(seed=seed)


def with_virtual_batches(
    loader: DPDataLoader, max_physical_batch_size: int | None, boundary: BatchBoundary
) -> DPDataLoader | VirtualBatchLoader:
    """The loader, or chunks of at most ``max_physical_batch_size`` of each logical batch."""
    if max_physical_batch_size is None:
        return loader
    return VirtualBatchLoader(loader, max_physical_batch_size, boundary)


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must update this model's parameters (not a copy's, e.g. after fix())."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    owned = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in owned:
                raise ValueError(
                    "the optimizer holds a parameter that is not in the model (was the optimizer "
                    "built before `model = dpfy.fix(model)`?); build it from model.parameters()"
                )
