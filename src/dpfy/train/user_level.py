"""User-level DP-SGD: Poisson-sample users, clip each sampled user's mean gradient to C.

When one person contributes many examples, example-level ε understates their exposure (guide
§2.1, §4.4). User-level DP-SGD (McMahan et al. 2018, "Learning differentially private recurrent
language models": DP-FedSGD with one local step) protects all of a user's examples together:

1. each step, every user joins independently with probability q = B_users / N_users
   (:class:`~dpfy.data.user_sampling.UserPoissonSampler`; the ledger gets a user-unit
   :class:`~dpfy.plan.sampling.SamplingRecord`);
2. each sampled user's gradient is the *mean* of the per-example gradients over their examples in
   the step — all of them, or ``max_examples_per_user`` drawn uniformly without replacement each
   time the user is sampled — computed exactly by the per-example engine's grouped clipping
   (``clip_and_accumulate(groups=user ids)``);
3. that mean is clipped to norm C; adding or removing one user changes the sum of clipped user
   gradients by at most C, so the sensitivity is **C** (not 2C: the whole user is the unit);
4. noise N(0, σ²C²) per coordinate is added to the sum, which is divided by the *expected* number
   of users B_users (DESIGN rule 1), and any torch optimizer post-processes the result.

Each step is accounted as ``PoissonSampledEvent(B_users / N_users, GaussianEvent(σ))`` in the
same ledger, accountants and budget guard as example-level DP-SGD; the run's ε is a user-level ε.
:func:`make_user_private` (or ``dpfy.make_private(..., user_ids=...)``) returns the usual
:class:`~dpfy.train.session.PrivateTraining`, whose loader yields ordinary batches.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dpfy._validate import check_count, check_delta, check_positive
from dpfy.data.loader import checked_loader_options, dataset_size_of
from dpfy.data.user_sampling import (
    UserDataLoader,
    check_user_ids,
    user_sampling_rate,
)
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind
from dpfy.train.grads import EngineChoice, LossReduction, make_engine
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.optim import BatchBoundary, DPOptimizer, NoiseSettings
from dpfy.train.session import (
    PrivateTraining,
    _accounting_for,
    _noise_multiplier,
    _resolve_steps,
    check_common,
    noise_source,
    seeded_generator,
    warn_if_delta_too_large,
)

__all__ = ["UserDPOptimizer", "group_privacy", "make_user_private"]


def group_privacy(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """What an example-level (ε, δ) guarantee says about a user holding ``group_size`` examples.

    Group privacy (Dwork & Roth 2014, "The algorithmic foundations of DP", thm. 2.2; guide §2.1):
    chaining the guarantee through the k datasets between "with" and "without" the user's k
    examples gives (kε, δ·Σ_{i<k} e^{iε}). The δ term grows like e^{(k-1)ε}, so for all but the
    smallest groups the example-level guarantee says nothing useful about a user — which is why
    a user-level run accounts users directly. A returned δ of 1.0 means no guarantee at all.
    """
    epsilon = check_positive("epsilon", epsilon)
    delta = check_delta(delta)
    k = check_count("group_size", group_size, minimum=1)
    # Σ_{i<k} e^{iε} = (e^{kε} - 1) / (e^ε - 1), computed without overflow for large kε
    log_sum = k * epsilon + math.log(-math.expm1(-k * epsilon)) - math.log(math.expm1(epsilon))
    return k * epsilon, min(1.0, math.exp(min(log_sum + math.log(delta), 0.0)))


class UserDPOptimizer(DPOptimizer):
    """A :class:`DPOptimizer` that clips the mean gradient of each user in the batch to C.

    The user id of each example comes with the batch from the run's :class:`UserDataLoader`
    (its published clipping units); everything after clipping (noise σC, ÷ expected users,
    budget guard, ledger) is the parent's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.settings.microbatch_size is not None:
            raise ValueError("user-level DP-SGD clips per user; do not set microbatch_size")

    @property
    def clipping_unit(self) -> str:
        """Each user's examples are one unit: the loader must say whose example is whose."""
        return "user"


def make_user_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_dataset: Dataset,
    *,
    user_ids: torch.Tensor,
    batch_size: int,
    delta: float,
    max_grad_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    loss_reduction: LossReduction = "mean",
    engine: EngineChoice = "auto",
    accountant: str = "pld",
    max_examples_per_user: int | None = None,
    secure_noise: bool = False,
    seed: int | None = None,
    batch_first: bool = True,
    loader_options: dict[str, Any] | None = None,
) -> PrivateTraining:
    """Make ``model`` + ``optimizer`` train with user-level DP-SGD (see the module docstring).

    ``user_ids[i]`` is the user (0..N_users-1, each holding data) of example i. ``batch_size`` is
    the *expected number of users* per step (q = batch_size / N_users) and ``epochs`` counts
    passes over the users (steps = ⌈E · N_users / B_users⌉). ``max_examples_per_user`` caps the
    examples one sampled user contributes to a step (drawn uniformly; None: all of them). The
    other arguments are those of :func:`dpfy.make_private`; ε, δ and the budget are user-level.
    """
    delta, max_grad_norm = check_common(model, optimizer, delta, max_grad_norm)
    ids = check_user_ids(user_ids, dataset_size_of(train_dataset))
    num_users = int(ids.max()) + 1
    if max_examples_per_user is not None:
        max_examples_per_user = check_count(
            "max_examples_per_user", max_examples_per_user, minimum=1
        )
    warn_if_delta_too_large(delta, num_users, "user")
    user_sampling_rate(num_users, batch_size)  # refuses B_users outside [1, N_users]
    total_steps = _resolve_steps(epochs, steps, num_users, batch_size)
    relation, accountant = _accounting_for(SamplingKind.POISSON, accountant)
    generator = seeded_generator(seed, secure_noise)
    loader = UserDataLoader(
        train_dataset,
        ids,
        batch_size,
        steps=total_steps,
        max_examples_per_user=max_examples_per_user,
        generator=generator,
        secure=secure_noise,
        **checked_loader_options(loader_options),
    )
    record = loader.sampling_record
    sigma = _noise_multiplier(
        target_epsilon, noise_multiplier, delta, record, total_steps, accountant, relation
    )
    ledger = PrivacyLedger(
        delta, accountant=accountant, target_epsilon=target_epsilon, relation=relation
    )
    grad_engine = make_engine(model, engine, batch_first=batch_first)
    noise = noise_source(secure_noise, None if seed is None else seed + 1)
    private_optimizer = UserDPOptimizer(
        optimizer,
        grad_engine,
        ledger,
        record,
        NoiseSettings(sigma, max_grad_norm, batch_size),  # sensitivity C, ÷ expected users
        provenance=loader.provenance,
        loss_reduction=loss_reduction,
        noise=noise,
        boundary=BatchBoundary(),
    )
    privacy = PrivacyPlan(
        dataset_size=num_users,
        expected_batch_size=batch_size,
        sampling_rate=record.sampling_rate,
        steps=total_steps,
        noise_multiplier=sigma,
        max_grad_norm=max_grad_norm,
        delta=delta,
        target_epsilon=target_epsilon,
        accountant=accountant,
        sampler=record.kind.value,
        microbatch_size=None,
        loss_reduction=loss_reduction,
        unit="user",
        examples=int(ids.numel()),
        max_examples_per_user=max_examples_per_user,
        seeded=seed is not None,
    )
    return PrivateTraining(model, private_optimizer, loader, ledger, grad_engine, privacy, noise)
