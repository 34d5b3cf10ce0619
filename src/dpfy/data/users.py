"""Split a labelled dataset into simulated users, skewed the way real federated data is.

User-level privacy (guide §2.1, §4.4) only means something when one person holds many examples,
and federated averaging is only tested honestly when users differ. Demo datasets (digits,
Fashion-MNIST) have no users, so :func:`split_users` invents them, reproducibly:

* **Label skew** — each user ``u`` draws class proportions ``p_u ~ Dirichlet(α · 1_K)``
  (Hsu, Qi & Brown 2019, "Measuring the effects of non-identical data distribution for
  federated visual classification"). Small α gives users few classes each; large α approaches IID.
* **Size skew** — each user draws an activity weight ``w_u ~ LogNormal(0, 1)``, so a few users
  hold many examples and many hold few (as in real deployments).
* Every example of class ``c`` goes to user ``u`` with probability ∝ ``w_u · p_u[c]``
  (one multinomial draw per class, then a random cut of that class's shuffled examples).
* Users left with fewer than ``min_examples`` examples are topped up with examples moved from the
  largest user, preferring the receiving user's own favourite class.

The split is a pure function of ``(labels, num_users, alpha, min_examples, seed)``. It uses the
labels, but only to build a simulation: a real deployment's users come with their own data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset

from dpfy._validate import check_count, check_positive

__all__ = ["SIZE_SIGMA", "UserSplit", "split_users"]

SIZE_SIGMA = 1.0  # σ of the log-normal user-size weights; 1.0 gives a max/median ratio ≈ 10
_WEIGHT_FLOOR = 1e-12  # keeps a class placeable when Dirichlet draws underflow to 0 (tiny α)


@dataclass(frozen=True, eq=False)
class UserSplit:
    """Which user owns each example, and how that assignment was made."""

    user_ids: torch.Tensor  # int64, length N: the user of example i
    num_users: int
    alpha: float
    min_examples: int
    seed: int
    num_classes: int

    def __post_init__(self) -> None:
        ids = self.user_ids
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError("user_ids must be a 1-D int64 tensor (one user id per example)")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_users):
            raise ValueError(f"user_ids must lie in [0, {self.num_users})")

    @property
    def num_examples(self) -> int:
        """N, the number of examples split."""
        return int(self.user_ids.numel())

    def indices(self, user: int) -> torch.Tensor:
        """The example indices user ``user`` holds (sorted, int64)."""
        user = check_count("user", user)
        if user >= self.num_users:
            raise ValueError(f"user must lie in [0, {self.num_users}), got {user}")
        return torch.nonzero(self.user_ids == user).flatten()

    def sizes(self) -> torch.Tensor:
        """Examples per user (int64, length ``num_users``)."""
        return torch.bincount(self.user_ids, minlength=self.num_users)

    def datasets(self, dataset: Any) -> list[Subset]:
        """One ``Subset`` of ``dataset`` per user; ``dataset`` must be the one that was split."""
        if len(dataset) != self.num_examples:
            raise ValueError(
                f"the dataset has {len(dataset)} examples but this split covers "
                f"{self.num_examples}; pass the dataset whose labels were split"
            )
        order = torch.argsort(self.user_ids, stable=True)
        chunks = torch.split(order, self.sizes().tolist())
        return [Subset(dataset, chunk.tolist()) for chunk in chunks]

    def describe(self) -> str:
        """One line for the report card: how the users were made."""
        sizes = self.sizes().float()
        return (
            f"{self.num_examples} examples split into {self.num_users} simulated users: "
            f"Dirichlet(alpha={self.alpha:g}) label skew over {self.num_classes} classes "
            f"(Hsu et al. 2019) and LogNormal(0, {SIZE_SIGMA:g}) user sizes, "
            f"at least {self.min_examples} example(s) each, seed {self.seed}; examples per "
            f"user min {int(sizes.min())} / median {int(sizes.median())} / "
            f"max {int(sizes.max())}"
        )


def split_users(
    labels: torch.Tensor | np.ndarray,
    num_users: int,
    *,
    alpha: float = 0.5,
    min_examples: int = 1,
    seed: int = 0,
) -> UserSplit:
    """Assign each labelled example to one of ``num_users`` users with skewed labels and sizes.

    Deterministic for a seed. Raises ValueError when ``num_users`` is below 1 or above the number
    of examples, when ``alpha`` is not positive, or when ``num_users · min_examples`` exceeds it.
    """
    label_array = _as_labels(labels)
    n = label_array.size
    num_users = check_count("num_users", num_users, minimum=1)
    if num_users > n:
        raise ValueError(
            f"num_users {num_users} exceeds the {n} examples; every user needs at least one "
            "example, so ask for at most that many users"
        )
    try:
        alpha = check_positive("alpha", alpha)
    except ValueError as err:
        raise ValueError(f"{err}; alpha is the Dirichlet concentration (0.5 is typical)") from None
    min_examples = check_count("min_examples", min_examples, minimum=1)
    if num_users * min_examples > n:
        raise ValueError(
            f"{num_users} users x min_examples {min_examples} needs {num_users * min_examples} "
            f"examples but there are only {n}; lower num_users or min_examples"
        )
    seed = check_count("seed", seed)
    rng = np.random.default_rng(seed)
    classes, label_codes = np.unique(label_array, return_inverse=True)
    weights = _user_class_weights(rng, num_users, len(classes), alpha)
    owners = _assign(rng, label_codes, weights)
    _top_up(rng, owners, label_codes, weights, min_examples)
    return UserSplit(
        user_ids=torch.from_numpy(owners.astype(np.int64)),
        num_users=num_users,
        alpha=alpha,
        min_examples=min_examples,
        seed=seed,
        num_classes=len(classes),
    )


def _as_labels(labels: torch.Tensor | np.ndarray) -> np.ndarray:
    """A 1-D numpy array of labels (any hashable, sortable dtype)."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"labels must be 1-D (one label per example), got shape {array.shape}")
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        raise ValueError("labels contain NaN or infinity; pass class labels")
    return array


def _user_class_weights(
    rng: np.random.Generator, num_users: int, num_classes: int, alpha: float
) -> np.ndarray:
    """w_u · p_u[c]: size weight times Dirichlet class proportions, shape (users, classes)."""
    proportions = rng.dirichlet(np.full(num_classes, alpha), size=num_users)
    proportions = np.nan_to_num(proportions, nan=0.0)  # defensive: underflow at tiny alpha
    sizes = rng.lognormal(0.0, SIZE_SIGMA, size=num_users)
    return sizes[:, None] * proportions + _WEIGHT_FLOOR


def _assign(rng: np.random.Generator, label_codes: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Deal each class's shuffled examples to users by one multinomial draw per class."""
    owners = np.empty(label_codes.size, dtype=np.int64)
    for c in range(weights.shape[1]):
        members = rng.permutation(np.flatnonzero(label_codes == c))
        column = weights[:, c] / weights[:, c].sum()
        counts = rng.multinomial(members.size, column)
        owners[members] = np.repeat(np.arange(weights.shape[0]), counts)
    return owners


def _top_up(
    rng: np.random.Generator,
    owners: np.ndarray,
    label_codes: np.ndarray,
    weights: np.ndarray,
    min_examples: int,
) -> None:
    """Move examples from the largest user to any user holding fewer than ``min_examples``."""
    num_users = weights.shape[0]
    sizes = np.bincount(owners, minlength=num_users)
    for user in np.flatnonzero(sizes < min_examples):
        favourite = int(np.argmax(weights[user]))
        while sizes[user] < min_examples:
            donor = int(np.argmax(sizes))  # > min_examples: the feasibility check guarantees it
            held = np.flatnonzero(owners == donor)
            preferred = held[label_codes[held] == favourite]
            pool = preferred if preferred.size else held
            moved = int(pool[rng.integers(pool.size)])
            owners[moved] = user
            sizes[donor] -= 1
            sizes[user] += 1
