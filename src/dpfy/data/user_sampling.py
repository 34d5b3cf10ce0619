"""Poisson sampling of *users* for user-level DP-SGD, and a loader that says whose example is whose.

User-level DP (guide §2.1, §4.4; McMahan et al. 2018) protects all examples of one user together,
so the sampled record is the user: each step, every user joins independently with probability
q = B_users / N_users and brings their examples (at most ``max_examples_per_user`` of them, drawn
uniformly without replacement afresh each time the user is sampled). The sampler's
:class:`~dpfy.plan.sampling.SamplingRecord` has ``unit="user"`` and ``dataset_size = N_users``, so
the ledger accounts ``PoissonSampledEvent(B_users / N_users, GaussianEvent(σ))`` per step.

:class:`UserDataLoader` yields ordinary collated batches (a user's examples are consecutive) and
publishes each with the user id of every example as its clipping units, which the private
optimizer reads to clip per user.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from dpfy._validate import check_count, check_sampling_rate
from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.collate_probe import Collated, ProbingCollate
from dpfy.data.loader import DPDataLoader, EmptyBatchCollate, dataset_size_of, empty_batch_like
from dpfy.data.provenance import Provenance
from dpfy.data.sampling import DpBatchSampler, epoch_length
from dpfy.plan.sampling import SamplingKind, SamplingRecord

__all__ = [
    "UserDataLoader",
    "UserPoissonSampler",
    "check_user_ids",
    "user_sampling_rate",
]


def check_user_ids(user_ids: Any, dataset_size: int | None = None) -> torch.Tensor:
    """One non-negative integer user id per example, users numbered 0..U-1, none without data.

    Refuses (ValueError naming the fix) a non-integer or non-1-D tensor, a length that is not
    the dataset's, negative ids, and ids that leave a user of ``range(max + 1)`` with no example.
    """
    if not isinstance(user_ids, torch.Tensor) or user_ids.dim() != 1:
        raise ValueError("user_ids must be a 1-D LongTensor with one user id per training example")
    if (
        user_ids.dtype.is_floating_point
        or user_ids.dtype.is_complex
        or user_ids.dtype == torch.bool
    ):
        raise ValueError(f"user_ids must hold integers, got dtype {user_ids.dtype}")
    ids = user_ids.detach().to("cpu", torch.int64)
    if dataset_size is not None and ids.numel() != dataset_size:
        raise ValueError(
            f"user_ids has {ids.numel()} entries but the dataset has {dataset_size} examples; "
            "pass one user id per example, in dataset order"
        )
    if ids.numel() == 0:
        raise ValueError("user_ids is empty: there are no users to train on")
    if int(ids.min()) < 0:
        raise ValueError(f"user_ids must be >= 0, found {int(ids.min())}; number users 0..U-1")
    sizes = torch.bincount(ids)
    empty = torch.nonzero(sizes == 0).flatten().tolist()
    if empty:
        shown = ", ".join(map(str, empty[:5])) + (", …" if len(empty) > 5 else "")
        raise ValueError(
            f"{len(empty)} user(s) hold no examples (ids {shown}); a user with no data cannot be "
            "sampled meaningfully and would inflate N_users — renumber users 0..U-1 so each holds "
            "data, e.g. torch.unique(user_ids, return_inverse=True)[1]"
        )
    return ids


def user_sampling_rate(num_users: int, expected_users: int) -> float:
    """q = B_users / N_users, refusing B_users outside [1, N_users] with the fix."""
    num_users = check_count("num_users", num_users, minimum=1)
    try:
        expected_users = check_count("batch_size", expected_users, minimum=1)
    except ValueError:
        raise ValueError(
            f"batch_size must be a whole number of users >= 1, got {expected_users!r}; at user "
            "level it is the expected number of users per step"
        ) from None
    if expected_users > num_users:
        raise ValueError(
            f"batch_size {expected_users} (expected users per step) exceeds the {num_users} "
            "users; lower batch_size to at most the number of users"
        )
    return expected_users / num_users


class UserPoissonSampler(DpBatchSampler):
    """Each step, every user joins independently with probability q; yields their example indices.

    Users are Poisson-sampled (``dataset_size`` is N_users); a sampled user's examples come
    consecutively, at most ``max_examples_per_user`` of them, drawn uniformly without replacement
    from that user's examples each time the user is sampled. An empty step yields ``[]``.
    """

    kind = SamplingKind.POISSON

    def __init__(
        self,
        user_ids: torch.Tensor,
        sampling_rate: float,
        steps: int | Fraction,
        generator: torch.Generator | None = None,
        *,
        max_examples_per_user: int | None = None,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        ids = check_user_ids(user_ids)
        self._sampling_rate = check_sampling_rate(sampling_rate)
        self.max_examples_per_user = (
            None
            if max_examples_per_user is None
            else check_count("max_examples_per_user", max_examples_per_user, minimum=1)
        )
        order = torch.argsort(ids, stable=True)
        self._members = list(torch.split(order, torch.bincount(ids).tolist()))
        self.num_examples = int(ids.numel())
        super().__init__(len(self._members), steps, generator, secure=secure, total=total)

    @property
    def num_users(self) -> int:
        """N_users: the population Poisson sampling draws from."""
        return self.dataset_size

    @property
    def expected_users(self) -> float:
        """q · N_users, what the user-level update divides by."""
        return self._sampling_rate * self.num_users

    @property
    def record(self) -> SamplingRecord:
        """Poisson sampling of users at rate q: the accounting assumption is met."""
        return SamplingRecord(
            SamplingKind.POISSON, self._sampling_rate, self.num_users, unit="user"
        )

    def _draw(self) -> torch.Tensor:
        users = self._source.bernoulli_indices(self.num_users, self._sampling_rate).tolist()
        parts = [self._examples_of(user) for user in users]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def _examples_of(self, user: int) -> torch.Tensor:
        """The user's examples, or a uniform subset of ``max_examples_per_user`` of them."""
        members = self._members[user]
        cap = self.max_examples_per_user
        if cap is None or members.numel() <= cap:
            return members
        return members[self._source.choice(members.numel(), cap)]

    def _identity(self) -> dict[str, Any]:
        return {
            **super()._identity(),
            "unit": "user",
            "num_examples": self.num_examples,
            "max_examples_per_user": self.max_examples_per_user,
        }


class _Tagged(Dataset):
    """The dataset's item together with the user id of that example."""

    def __init__(self, dataset: Dataset, user_ids: torch.Tensor) -> None:
        self.dataset, self.user_ids = dataset, user_ids

    def __len__(self) -> int:
        return len(self.user_ids)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.dataset[index], int(self.user_ids[index])


class _TaggedCollate:
    """Collate the items as usual (empty batches too) and stack their user ids beside them."""

    def __init__(self, inner: ProbingCollate) -> None:
        self.inner = inner

    def __call__(self, samples: list[tuple[Any, int]]) -> tuple[Collated, torch.Tensor]:
        items = [item for item, _ in samples]
        return self.inner(items), torch.tensor([u for _, u in samples], dtype=torch.int64)


class UserDataLoader(DPDataLoader):
    """A :class:`DPDataLoader` over Poisson-sampled users; publishes each batch's user ids.

    Batches look exactly like the dataset's usual collated batches; each is published with the
    user id of each of its examples as its clipping units (``provenance.current.units``).
    Checkpoint state, resumption, passes and the sampling record work as for
    :class:`DPDataLoader`; an epoch is N_users / B steps, ``steps`` bounds the run.
    """

    def __init__(
        self,
        dataset: Dataset,
        user_ids: torch.Tensor,
        expected_users: int,
        *,
        steps: int,
        max_examples_per_user: int | None = None,
        generator: torch.Generator | None = None,
        secure: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_generator: torch.Generator | None = None,
        behaviour_checks: CheckSchedule | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        ids = check_user_ids(user_ids, dataset_size_of(dataset))
        num_users = int(ids.max()) + 1
        rate = user_sampling_rate(num_users, expected_users)
        sampler = UserPoissonSampler(
            ids,
            rate,
            epoch_length(num_users, expected_users),
            generator,
            max_examples_per_user=max_examples_per_user,
            secure=secure,
            total=check_count("steps", steps, minimum=1),
        )
        for name in ("batch_size", "shuffle", "batch_sampler", "drop_last", "sampler"):
            if name in dataloader_kwargs:
                raise ValueError(f"UserDataLoader chooses {name} itself; do not pass it")
        collate = collate_fn if collate_fn is not None else default_collate
        empty = EmptyBatchCollate(collate, empty_batch_like(collate, dataset))
        self.check_schedule = behaviour_checks if behaviour_checks is not None else CheckSchedule()
        # DPDataLoader's own __init__ builds an example-level sampler; build the DataLoader part
        # directly and set the attributes DPDataLoader's methods read.
        DataLoader.__init__(
            self,
            _Tagged(dataset, ids),
            batch_sampler=sampler,
            collate_fn=_TaggedCollate(ProbingCollate(empty, self.check_schedule)),
            generator=worker_generator,  # seeds worker processes only; never the sampling
            **dataloader_kwargs,
        )
        self.user_dataset = dataset
        self.expected_batch_size = expected_users
        self._consumed = 0
        self.provenance = Provenance()
        self.microbatches = None

    @property
    def num_users(self) -> int:
        """N_users."""
        return self.dp_sampler.dataset_size

    def _publish(self, batch: Any) -> Any:
        """Publish the batch with its examples' user ids as the clipping units."""
        collated, users = batch
        self._announce(int(users.numel()), users, "user", collated.verdict)
        return collated.batch
