"""What a sampler did, stated plainly enough that the ledger and report never have to guess.

DESIGN rule 4: the sampler, not the user, tells the ledger how data was drawn. A sampler hands out
a :class:`SamplingRecord`; the ledger turns it into a :class:`~dpfy.accounting.DpEvent` for each
step. Shuffled or fixed-size batches are never silently accounted as Poisson (guide §4.3, §5.3.1):
the record says which event is accounted and whether that event really describes the sampling.

This module is torch-free so a ledger can be loaded and reported without torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dpfy._validate import check_count, check_sampling_rate
from dpfy.accounting.events import (
    DpEvent,
    FixedSizeSampledEvent,
    GaussianEvent,
    PoissonSampledEvent,
)


class SamplingKind(enum.Enum):
    """How batches were drawn from the dataset."""

    POISSON = "poisson"
    SHUFFLE = "shuffle"
    FIXED_SIZE = "fixed-size"

    @property
    def description(self) -> str:
        """One sentence for the privacy report (guide §5.3.3: say whether assumptions hold)."""
        return _DESCRIPTIONS[self]

    @classmethod
    def parse(cls, value: SamplingKind | str) -> SamplingKind:
        """Accept the enum or its hyphenated name, with an error that lists the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower().replace("_", "-"))
        except ValueError:
            choices = ", ".join(k.value for k in cls)
            raise ValueError(f"sampling must be one of {choices}; got {value!r}") from None


_DESCRIPTIONS = {
    SamplingKind.POISSON: (
        "Poisson sampling: every example joins each batch independently with probability q "
        "(batch sizes vary; empty batches are steps too)."
    ),
    SamplingKind.SHUFFLE: (
        "Shuffled fixed-size batches, one pass per epoch: NOT Poisson. It is accounted as if it "
        "were Poisson with q = B/N, an assumption it does not meet (guide §4.3)."
    ),
    SamplingKind.FIXED_SIZE: (
        "Fixed-size batches drawn uniformly without replacement at every step: NOT Poisson. "
        "Accounted as fixed-size subsampling, which has sound bounds under replace-one "
        "adjacency only."
    ),
}


@dataclass(frozen=True)
class SamplingRecord:
    """How one step's batch was drawn; the accounted event and its honesty derive from it.

    ``sampling_rate`` is q = B/N from the dataset size and the (expected) batch size, never from a
    loader length. ``batch_size`` is the fixed batch size for the non-Poisson kinds and None for
    Poisson, whose realised size is random and must not influence accounting (DESIGN rule 1).
    """

    kind: SamplingKind
    sampling_rate: float
    dataset_size: int
    batch_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SamplingKind.parse(self.kind))
        object.__setattr__(self, "sampling_rate", check_sampling_rate(self.sampling_rate))
        object.__setattr__(
            self, "dataset_size", check_count("dataset_size", self.dataset_size, minimum=1)
        )
        if self.kind is SamplingKind.POISSON:
            if self.batch_size is not None:
                raise ValueError(
                    "a Poisson record has no fixed batch_size (its size is random); pass None"
                )
            return
        if self.batch_size is None:
            raise ValueError(f"a {self.kind.value} record needs its fixed batch_size")
        object.__setattr__(
            self, "batch_size", check_count("batch_size", self.batch_size, minimum=1)
        )
        if self.batch_size > self.dataset_size:
            raise ValueError(
                f"batch_size must be at most dataset_size ({self.dataset_size}), "
                f"got {self.batch_size}"
            )

    @property
    def assumption_met(self) -> bool:
        """Whether :meth:`event` describes what the sampler really did (False for shuffling)."""
        return self.kind is not SamplingKind.SHUFFLE

    @property
    def description(self) -> str:
        """The report sentence for this kind of sampling."""
        return self.kind.description

    def event(self, noise_multiplier: float) -> DpEvent:
        """The event accounted for one DP-SGD step with noise multiplier σ (DESIGN rule 4).

        Poisson and shuffle both give ``PoissonSampledEvent(q, GaussianEvent(σ))`` — for the
        shuffle sampler that is an assumption not met, and :attr:`assumption_met` says so.
        Fixed-size sampling gives its honest ``FixedSizeSampledEvent``.
        """
        if self.kind is SamplingKind.FIXED_SIZE:
            return FixedSizeSampledEvent(
                self.dataset_size, self.batch_size, GaussianEvent(noise_multiplier)
            )
        return self.poisson_event(noise_multiplier)

    def poisson_event(self, noise_multiplier: float) -> DpEvent:
        """The event this step would be under Poisson sampling at the same q (for comparison)."""
        return PoissonSampledEvent(self.sampling_rate, GaussianEvent(noise_multiplier))

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form, for ledgers and reports."""
        return {
            "kind": self.kind.value,
            "sampling_rate": self.sampling_rate,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SamplingRecord:
        """Inverse of :meth:`to_dict`; validation errors are ValueErrors."""
        if not isinstance(data, dict):
            raise ValueError(f"a sampling record must be a dict, got {type(data).__name__}")
        unknown = set(data) - {"kind", "sampling_rate", "dataset_size", "batch_size"}
        if unknown:
            raise ValueError(f"unknown sampling record fields: {sorted(unknown)}")
        try:
            return cls(
                kind=data["kind"],
                sampling_rate=data["sampling_rate"],
                dataset_size=data["dataset_size"],
                batch_size=data.get("batch_size"),
            )
        except KeyError as missing:
            raise ValueError(f"sampling record lacks the field {missing}") from None
        except TypeError as err:
            raise ValueError(f"malformed sampling record: {err}") from None
