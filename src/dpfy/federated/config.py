"""The settings of ``dpfy federated``, torch-free so the CLI can show their defaults cheaply."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dpfy._validate import check_count, check_learning_rate, check_positive, check_seed

if TYPE_CHECKING:
    from dpfy.federated.fedavg import FedAvgConfig

__all__ = ["SERVER_OPTIMIZER_NAMES", "FederatedConfig"]

#: The server optimizers ``dpfy.federated.aggregate.SERVER_OPTIMIZERS`` registers (kept here,
#: torch-free, so a bad name is refused before any data is loaded or any directory is made).
SERVER_OPTIMIZER_NAMES = ("sgd", "momentum", "adam")


@dataclass(frozen=True)
class FederatedConfig:
    """Everything ``dpfy federated`` needs; the defaults train digits over 100 skewed users.

    The defaults came from a small manual search on digits at user-level ε = 4 (not accounted:
    treat them as public starting points, guide §5.4.2).
    """

    dataset: str = "digits"
    model: str = "logreg"
    users: int = 100
    alpha: float = 0.5
    clients_per_round: int = 30
    rounds: int = 60
    local_steps: int = 20
    local_batch_size: int | None = 16
    client_lr: float = 0.5
    server_lr: float = 1.0
    server_optimizer: str = "sgd"
    clip_norm: float = 1.0
    target_epsilon: float = 4.0
    delta: float | None = None
    accountant: str = "pld"
    seed: int | None = None  # sampling and noise; None: OS entropy (see run_config.public_seed)
    out: Path | None = None
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        """Refuse bad settings before anything is loaded or written (names match the flags)."""
        check_count("users", self.users, minimum=1)
        check_positive("alpha", self.alpha)
        check_count("clients_per_round", self.clients_per_round, minimum=1)
        check_count("rounds", self.rounds, minimum=1)
        check_count("local_steps", self.local_steps, minimum=1)
        if self.local_batch_size is not None:
            check_count("local_batch_size", self.local_batch_size, minimum=1)
        for name in ("clip_norm", "target_epsilon"):
            check_positive(name, getattr(self, name))
        for name in ("client_lr", "server_lr"):
            check_learning_rate(name, getattr(self, name))
        check_seed(self.seed)
        if str(self.server_optimizer).strip().lower() not in SERVER_OPTIMIZER_NAMES:
            raise ValueError(
                f"server optimizer must be one of {', '.join(SERVER_OPTIMIZER_NAMES)}; got "
                f"{self.server_optimizer!r}"
            )
        if self.clients_per_round > self.users:
            raise ValueError(
                f"--clients-per-round {self.clients_per_round} exceeds --users {self.users}; "
                "lower it to at most the number of users"
            )

    def resolved_delta(self) -> float:
        """δ as given, or a power of ten at least 10× below 1/N_users (guide §2.1: δ ≪ 1/N)."""
        if self.delta is not None:
            return self.delta
        return 10.0 ** -(math.ceil(math.log10(self.users)) + 1)

    @property
    def algorithm_name(self) -> str:
        """The plan's name of the algorithm these settings run: 'dp-fedsgd' or 'dp-fedavg'."""
        from dpfy.federated.fedavg import algorithm_of

        return algorithm_of(self.local_steps, self.local_batch_size, self.client_lr).lower()

    def fedavg(self, noise_multiplier: float) -> FedAvgConfig:
        """The algorithm's settings at the calibrated σ."""
        from dpfy.federated.fedavg import FedAvgConfig

        return FedAvgConfig(
            clients_per_round=self.clients_per_round,
            noise_multiplier=noise_multiplier,
            clip_norm=self.clip_norm,
            local_steps=self.local_steps,
            local_batch_size=self.local_batch_size,
            client_lr=self.client_lr,
            server_lr=self.server_lr,
            server_optimizer=self.server_optimizer,
        )
