"""DP-FedAvg and DP-FedSGD: user-level differential privacy by federated averaging (guide alg. 2).

One round (guide §4.4; McMahan et al. 2018):

1. every user joins independently with probability q = B_c / N_users (Poisson sampling, the same
   sampler DP-SGD uses, so a round is accounted as the same event as a DP-SGD step at (q, σ));
2. each sampled user starts from the global model θ and runs K steps of minibatch SGD (client
   learning rate η_c, local batch B_m) on their own data;
3. each user's model change Δ_u = θ_u − θ is clipped to L2 norm C over all trainable parameters;
4. the clipped changes are summed, N(0, σ²C²) is added once per coordinate, and the sum is divided
   by the expected B_c (never by the realised count, which depends on the data);
5. the server optimizer applies the noisy average with server learning rate η_s (SGD, momentum,
   Adam…: post-processing).

DP-FedSGD is the special case K = 1 on the user's full local batch with η_c = 1, so Δ_u is minus
the user's average gradient (guide §4.4): :meth:`FedAvgConfig.fedsgd`.

The guarantee is user-level under add/remove-one-user adjacency: all of one user's examples
together are the protected record. The budget guard runs before a round changes anything.
Only trainable parameters are averaged (frozen ones are never touched); models with BatchNorm are
refused: buffers are not aggregated, so the global running statistics would never
be learned — use GroupNorm (``dpfy.fix``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from dpfy._validate import check_count, check_positive
from dpfy.data.sampling import PoissonSampler, sampling_rate_for
from dpfy.federated.aggregate import (
    ClippedSum,
    MalformedUpdate,
    ServerUpdate,
    make_server_optimizer,
)
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.plan.variants import PlanRequest, make_plan
from dpfy.train.builder import warn_if_delta_too_large
from dpfy.train.checks import check_model
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.noise.source import NoiseSource, SecureNoise, TorchNoise
from dpfy.train.private_aggregation import PrivateAggregation
from dpfy.train.step_record import StepRecord

__all__ = [
    "DPFedAvg",
    "FedAvgConfig",
    "RoundResult",
    "UserRoundSampler",
    "calibrate_user_noise",
    "check_ledger",
    "check_seeding",
    "check_user_datasets",
    "federated_plan",
]

log = logging.getLogger("dpfy.federated")

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FedAvgConfig:
    """The hyperparameters of guide alg. 2: B_c, σ, C, K, B_m, η_c, η_s and the server optimizer.

    ``local_batch_size=None`` means each local step uses all of the user's examples.
    """

    clients_per_round: int
    noise_multiplier: float
    clip_norm: float
    local_steps: int = 1
    local_batch_size: int | None = None
    client_lr: float = 0.1
    server_lr: float = 1.0
    server_optimizer: str = "sgd"

    def __post_init__(self) -> None:
        check_count("clients_per_round", self.clients_per_round, minimum=1)
        check_positive("noise_multiplier", self.noise_multiplier)
        check_positive("clip_norm", self.clip_norm)
        check_count("local_steps", self.local_steps, minimum=1)
        if self.local_batch_size is not None:
            check_count("local_batch_size", self.local_batch_size, minimum=1)
        check_positive("client_lr", self.client_lr)
        check_positive("server_lr", self.server_lr)

    @classmethod
    def fedsgd(
        cls,
        clients_per_round: int,
        noise_multiplier: float,
        clip_norm: float,
        *,
        server_lr: float = 1.0,
        server_optimizer: str = "sgd",
    ) -> FedAvgConfig:
        """DP-FedSGD: one local step on the full local batch with η_c = 1 (guide §4.4)."""
        return cls(
            clients_per_round,
            noise_multiplier,
            clip_norm,
            local_steps=1,
            local_batch_size=None,
            client_lr=1.0,
            server_lr=server_lr,
            server_optimizer=server_optimizer,
        )

    @property
    def algorithm(self) -> str:
        """'DP-FedSGD' for one full-batch local step at η_c = 1, else 'DP-FedAvg'."""
        return algorithm_of(self.local_steps, self.local_batch_size, self.client_lr)


def algorithm_of(local_steps: int, local_batch_size: int | None, client_lr: float) -> str:
    """'DP-FedSGD' for one full-batch local step at η_c = 1 (guide §4.4), else 'DP-FedAvg'."""
    one_step = local_steps == 1 and local_batch_size is None
    return "DP-FedSGD" if one_step and client_lr == 1.0 else "DP-FedAvg"


@dataclass(frozen=True)
class RoundResult:
    """What one round did; ``sampled`` and ``dropped`` are user indices (diagnostics only)."""

    round: int
    sampled: tuple[int, ...]
    dropped: tuple[int, ...]
    update_norms: tuple[float, ...]

    @property
    def accepted(self) -> int:
        """Users whose clipped change entered the sum."""
        return len(self.sampled) - len(self.dropped)


def check_user_datasets(users: Sequence[Dataset]) -> list[Dataset]:
    """Every user must hold at least one example; the error names the empty ones and the fix."""
    users = list(users)
    if not users:
        raise ValueError("there are no users: pass one dataset per user")
    empty = [i for i, data in enumerate(users) if len(data) == 0]  # type: ignore[arg-type]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (", …" if len(empty) > 10 else "")
        raise ValueError(
            f"{len(empty)} user(s) have no data (users {shown}); drop them before training, or "
            "split with dpfy.data.users.split_users(..., min_examples=1)"
        )
    return users


def check_seeding(seed: int | None, secure: bool) -> None:
    """A seed makes sampling and noise replayable, secure=True unpredictable: not both."""
    if seed is not None and secure:
        raise ValueError(
            "seed and secure=True exclude each other: a seed makes sampling and noise "
            "reproducible, secure draws them from the OS CSPRNG; pass one or the other"
        )


def check_ledger(ledger: PrivacyLedger) -> PrivacyLedger:
    """Every round must be accounted: a dpfy PrivacyLedger is required."""
    if not isinstance(ledger, PrivacyLedger):
        raise ValueError(
            f"ledger must be a dpfy.train.ledger.PrivacyLedger, got {type(ledger).__name__}; "
            "build one with PrivacyLedger(delta, target_epsilon=...)"
        )
    return ledger


def calibrate_user_noise(
    target_epsilon: float,
    delta: float,
    num_users: int,
    clients_per_round: int,
    rounds: int,
    *,
    accountant: str = "pld",
) -> float:
    """The smallest σ for ``rounds`` rounds at q = B_c / N_users to meet user-level (ε, δ)."""
    sampling_rate_for(num_users, clients_per_round)  # refuses B_c outside [1, N_users]
    return federated_plan(
        num_users, clients_per_round, rounds, delta=delta, clip_norm=1.0,
        target_epsilon=target_epsilon, accountant=accountant,
    ).noise_multiplier  # fmt: skip


def federated_plan(
    num_users: int,
    clients_per_round: int,
    rounds: int,
    *,
    delta: float,
    clip_norm: float,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    accountant: str = "pld",
    algorithm: str = "dp-fedavg",
    examples: int | None = None,
    seeded: bool = False,
) -> PrivacyPlan:
    """The privacy plan of a federated run, from the same variants registry as every private run."""
    return make_plan(
        PlanRequest(
            records=num_users,
            batch_size=clients_per_round,
            delta=delta,
            max_grad_norm=clip_norm,
            steps=rounds,
            target_epsilon=target_epsilon,
            noise_multiplier=noise_multiplier,
            accountant=accountant,
            examples=examples,
            seeded=seeded,
        ),
        algorithm,
        "user",
    )


class UserRoundSampler(PoissonSampler):
    """Poisson sampling of user indices, one draw per round; its record's unit is "user".

    The sampler, not the trainer, tells the ledger what was sampled: q = B_c /
    N_users over users, accounted as ``PoissonSampledEvent(q, GaussianEvent(σ))`` per round.
    """

    @property
    def record(self) -> SamplingRecord:
        """Poisson over users at rate q."""
        return SamplingRecord(
            SamplingKind.POISSON, self._sampling_rate, self.dataset_size, unit="user"
        )


class DPFedAvg:
    """In-process DP-FedAvg over simulated users; each :meth:`round` is one private release.

    ``users`` holds one dataset per user (items ``(x, y)``). ``rounds`` is the planned number of
    rounds (the Poisson sampler's pass length; more may be run while the budget allows).
    ``seed`` makes user sampling, local batches and noise reproducible; without it sampling and
    noise are seeded from the OS. ``server_optimizer`` may be any torch optimizer over the
    model's trainable parameters; by default the config's registered one is built.
    """

    def __init__(
        self,
        model: nn.Module,
        users: Sequence[Dataset],
        config: FedAvgConfig,
        ledger: PrivacyLedger,
        *,
        rounds: int,
        loss_fn: LossFunction | None = None,
        seed: int | None = None,
        noise: NoiseSource | None = None,
        server_optimizer: torch.optim.Optimizer | None = None,
        secure: bool = False,
    ) -> None:
        check_model(model)  # batch-coupled layers are refused
        self.users = check_user_datasets(users)
        if config.clients_per_round > len(self.users):
            raise ValueError(
                f"clients_per_round {config.clients_per_round} exceeds the {len(self.users)} "
                "users; lower clients_per_round to at most the number of users"
            )
        self.model, self.config, self.ledger = model, config, check_ledger(ledger)
        warn_if_delta_too_large(ledger.delta, len(self.users), "user")
        self.loss_fn = loss_fn or nn.functional.cross_entropy
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("the model has no trainable parameters: nothing to train")
        check_seeding(seed, secure)
        seeded = seed is not None
        self.sampler = UserRoundSampler.from_batch_size(
            len(self.users),
            config.clients_per_round,
            check_count("rounds", rounds, minimum=1),
            torch.Generator().manual_seed(seed) if seeded else None,
            secure=secure,
        )
        if noise is None:
            noise = SecureNoise() if secure else TorchNoise(None if seed is None else seed + 1)
        self.noise = noise
        self._local_generator = torch.Generator()
        if seed is not None:
            self._local_generator.manual_seed(seed + 2)
        else:
            self._local_generator.seed()
        optimizer = server_optimizer or make_server_optimizer(
            config.server_optimizer, self.params.values(), config.server_lr
        )
        self.server = ServerUpdate(self.params, _check_optimizer(optimizer, self.params))
        self.record = StepRecord(self.sampler.record, config.noise_multiplier)
        self._worker = copy.deepcopy(model)
        self._worker_params = {n: p for n, p in self._worker.named_parameters() if n in self.params}
        self._batches: Iterator[list[int]] = iter(())
        self.rounds_done = 0

    @property
    def num_users(self) -> int:
        """N_users, the population Poisson sampling draws from."""
        return len(self.users)

    @property
    def sampling_rate(self) -> float:
        """q = B_c / N_users."""
        return self.sampler.sampling_rate

    def round(self) -> RoundResult:
        """Run one private round; raises BudgetExhausted (nothing applied) when it would not fit."""
        self.ledger.check_step(self.record)
        sampled = self._next_users()
        aggregation = PrivateAggregation.gaussian(
            frozenset(self.params),
            self.noise,
            self.config.noise_multiplier,
            self.config.clip_norm,
            self.config.clients_per_round,
        )
        like = {n: p.detach() for n, p in self.params.items()}
        total = ClippedSum(like, self.config.clip_norm, aggregation)
        dropped = []
        for user in sampled:
            try:
                total.add(self._local_update(user))
            except MalformedUpdate as err:  # a diverged user counts as zero: always safe
                log.warning("round %d: user %d dropped: %s", self.rounds_done + 1, user, err)
                dropped.append(user)
        update = total.noisy_mean()
        self.server.apply(update)
        self.ledger.record(self.record)
        self.rounds_done += 1
        return RoundResult(self.rounds_done, tuple(sampled), tuple(dropped), tuple(total.norms))

    def _next_users(self) -> list[int]:
        """The next Poisson draw of users (a new pass of the sampler when one ends)."""
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.sampler)
            return next(self._batches)

    def _local_update(self, user: int) -> dict[str, torch.Tensor]:
        """K local SGD steps from the global model on ``user``'s data; returns θ_u − θ."""
        with torch.no_grad():
            for name, param in self._worker_params.items():
                param.copy_(self.params[name])
        data = self.users[user]
        params = list(self._worker_params.values())
        self._worker.train()
        for _ in range(self.config.local_steps):
            x, y = self._local_batch(data)
            loss = self.loss_fn(self._worker(x), y)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            with torch.no_grad():
                for param, grad in zip(params, grads, strict=True):
                    if grad is not None:
                        param.sub_(grad, alpha=self.config.client_lr)
        return {n: p.detach() - self.params[n].detach() for n, p in self._worker_params.items()}

    def _local_batch(self, data: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        """B_m examples drawn without replacement (all of them when B_m is None or ≥ n_u)."""
        n = len(data)  # type: ignore[arg-type]
        size = self.config.local_batch_size
        if size is None or size >= n:
            indices = range(n)
        else:
            indices = torch.randperm(n, generator=self._local_generator)[:size].tolist()
        return default_collate([data[i] for i in indices])


def _check_optimizer(
    optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter]
) -> torch.optim.Optimizer:
    """The server optimizer may only update the model's trainable parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"server_optimizer must be a torch optimizer, got {optimizer!r}")
    known = {id(p) for p in params.values()}
    for group in optimizer.param_groups:
        if any(id(p) not in known for p in group["params"]):
            raise ValueError(
                "the server optimizer holds tensors that are not trainable parameters of the "
                "model; build it over [p for p in model.parameters() if p.requires_grad]"
            )
    return optimizer
