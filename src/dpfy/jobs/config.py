"""The settings of ``dpfy train``, torch-free so the CLI can show their defaults cheaply."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dpfy._validate import check_positive_at_most

#: Optimizers the trainer offers (each post-processes the private gradient, guide §5.5.2).
OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "adagrad")

#: Units of privacy ``dpfy train`` offers: per example (DP-SGD), or per simulated user
#: (user-level DP-SGD on :func:`dpfy.data.users.split_users`; batch_size then counts users).
UNIT_NAMES = ("example", "user")

#: Training algorithms ``dpfy train`` offers: DP-SGD (Poisson sampling) or DP-FTRL (shuffled
#: batches, tree-aggregation noise, no sampling assumption; example level only).
ALGORITHM_NAMES = ("dp-sgd", "dp-ftrl")

#: Upper bound on --epochs (and tuning's --trial-epochs): generous, as DP runs take tens to
#: hundreds of passes, and it keeps the ⌈E·N/B⌉ steps within what the accountants compose.
MAX_EPOCHS = 10_000


def check_epochs(name: str, value: float) -> float:
    """Epochs lie in (0, MAX_EPOCHS]: a longer run never ends and overflows the accounting."""
    return check_positive_at_most(
        name, value, MAX_EPOCHS, "no DP run needs more passes over its data"
    )


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``dpfy train`` needs; the defaults train digits at ε = 3 in under a minute."""

    dataset: str = "digits"
    model: str = "mlp"
    target_epsilon: float = 3.0
    delta: float | None = None
    epochs: float = 20
    batch_size: int = 128
    max_grad_norm: float = 1.0
    lr: float = 0.01
    optimizer: str = "adam"
    out: Path | None = None
    #: Seeds sampling and noise (experiments only: the report flags a seeded run as not private
    #: against anyone who knows the seed). None: OS entropy.
    seed: int | None = None
    baseline: bool = False
    data_dir: Path | None = None
    engine: str = "auto"
    unit: str = "example"
    users: int = 100
    max_examples_per_user: int | None = None
    algorithm: str = "dp-sgd"

    def resolved_delta(self, dataset_size: int) -> float:
        """δ as given, or a power of ten at least 10× below 1/N (guide §2.1: δ ≪ 1/N)."""
        if self.delta is not None:
            return self.delta
        return 10.0 ** -(math.ceil(math.log10(dataset_size)) + 1)


def public_seed(seed: int | None) -> int:
    """The seed for what is public anyway — model init, simulated splits, candidate grids.

    An unset seed fixes these at 0 so that runs stay comparable, while sampling and noise (the
    private randomness) come from OS entropy.
    """
    return 0 if seed is None else seed
