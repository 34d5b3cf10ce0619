"""What a sampler did, stated plainly enough that the ledger and report never have to guess.

The sampler, not the user, tells the ledger how data was drawn. A sampler hands out
a :class:`SamplingRecord`; the ledger turns it into a :class:`~dpfy.plan.accounting.DpEvent` for
each
step. Shuffled or fixed-size batches are never silently accounted as Poisson (guide §4.3, §5.3.1):
the record says which event is accounted and whether that event really describes the sampling.

This module is torch-free so a ledger can be loaded and reported without torch.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from dpfy._validate import check_count, check_sampling_rate
from dpfy.plan.accounting.events import (
    BallsInBinsEpochEvent,
    DpEvent,
    FixedSizeSampledEvent,
    GaussianEvent,
    NoOpEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
    TruncatedPoissonSampledEvent,
)


class SamplingKind(enum.Enum):
    """How batches were drawn from the dataset."""

    POISSON = "poisson"
    TRUNCATED_POISSON = "truncated-poisson"  # Poisson cut to M and padded to M rows
    SHUFFLE = "shuffle"
    BALLS_IN_BINS = "balls-in-bins"  # each example in one uniformly random batch per epoch
    FIXED_SIZE = "fixed-size"
    TREE_SHUFFLE = "tree-shuffle"  # DP-FTRL: no sampling assumption
    TREE_FIXED_ORDER = "tree-fixed-order"
    FIXED_ORDER_EPOCHS = "fixed-order-epochs"  # BandMF / BLT: the mechanism accounts each step
    CYCLIC_POISSON = "cyclic-poisson"  # amplified BandMF: the mechanism accounts each step

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
    SamplingKind.TRUNCATED_POISSON: (
        "Truncated Poisson sampling: every example joins each batch independently with "
        "probability q, a batch of more than M examples keeps M of them at random, and every "
        "batch is padded to exactly M rows (padding rows are masked out of clipping, sums and "
        "counts). Accounted as Poisson sampling plus the chance a batch is cut, charged in δ."
    ),
    SamplingKind.SHUFFLE: (
        "Shuffled fixed-size batches, one pass per epoch: NOT Poisson. It is accounted as if it "
        "were Poisson with q = B/N, an assumption it does not meet (guide §4.3)."
    ),
    SamplingKind.BALLS_IN_BINS: (
        "Balls-in-bins sampling (Chua et al. 2025): at the start of every epoch of k = N // B "
        "steps, each example was assigned to one of the epoch's k batches uniformly at random, "
        "independently of the others (batch sizes vary; empty batches are steps too). Each "
        "epoch is charged at its first step as random allocation of each example to 1 of k "
        "Gaussian steps of noise σ (Feldman & Shenfeld 2025): a proven upper bound, computed "
        "without sampling, that includes the amplification from the random assignment."
    ),
    SamplingKind.FIXED_SIZE: (
        "Fixed-size batches drawn uniformly without replacement at every step: NOT Poisson. "
        "Accounted as fixed-size subsampling, which has sound bounds under replace-one "
        "adjacency only."
    ),
    SamplingKind.TREE_SHUFFLE: (
        "Shuffled fixed-size batches, one pass per epoch, trained with DP-FTRL: NO sampling "
        "assumption is used. The noise is accounted as tree aggregation (Kairouz et al. 2021), "
        "which holds for any data order in which each example enters a tree at most once."
    ),
    SamplingKind.TREE_FIXED_ORDER: (
        "Fixed-size batches in a fixed order, one pass per epoch, trained with DP-FTRL: NO "
        "sampling assumption is used. The noise is accounted as tree aggregation (Kairouz et al. "
        "2021), which holds for any data order in which each example enters a tree at most once."
    ),
    SamplingKind.FIXED_ORDER_EPOCHS: (
        "Fixed-size batches in one order drawn before training (a random permutation, "
        "independent of the data) and repeated every epoch: each example is in at most one "
        "batch per epoch, always N // B steps apart. NO sampling assumption is used: the "
        "correlated noise (matrix factorisation) is accounted under this min-separation "
        "participation (Choquette-Choo et al. 2022), by the noise mechanism, not by this record."
    ),
    SamplingKind.CYCLIC_POISSON: (
        "Cyclic Poisson sampling: the examples were split once, before training and "
        "independently of the data, into b fixed groups; step t took every example of group "
        "t mod b independently with probability q = b·B/N (batch sizes vary; empty batches are "
        "steps too). Amplified BandMF accounts it (Choquette-Choo et al. 2023), by the noise "
        "mechanism, not by this record."
    ),
}

#: Kinds whose steps are DP-FTRL tree-aggregation steps rather than subsampled Gaussians.
TREE_KINDS = frozenset({SamplingKind.TREE_SHUFFLE, SamplingKind.TREE_FIXED_ORDER})

#: Kinds that state how batches were taken but carry no privacy event of their own: the noise
#: mechanism supplies each step's event (samplers describe sampling only).
MECHANISM_ACCOUNTED_KINDS = frozenset(
    {SamplingKind.FIXED_ORDER_EPOCHS, SamplingKind.CYCLIC_POISSON}
)

#: Kinds whose batch size is random (every record joins independently): no fixed batch_size.
POISSON_KINDS = frozenset({SamplingKind.POISSON, SamplingKind.CYCLIC_POISSON})


#: The record a sampler draws: one example, or one user with all of their examples (guide §2.1).
SAMPLING_UNITS = ("example", "user")

_USER_POISSON = (
    "Poisson sampling of users: every user joins each step independently with probability q "
    "(the number of users varies; empty steps are steps too), bringing their examples with them."
)


@dataclass(frozen=True)
class SamplingRecord:
    """How one step's batch was drawn; the accounted event and its honesty derive from it.

    ``sampling_rate`` is q = B/N from the dataset size and the (expected) batch size, never from a
    loader length. ``batch_size`` is the fixed batch size for the non-Poisson kinds and None for
    Poisson, whose realised size is random and must not influence accounting.
    ``unit`` is what was sampled: ``"example"``, or ``"user"`` — then ``dataset_size`` counts
    users and q = B_users / N_users (user-level DP, guide §2.1, §4.4).
    """

    kind: SamplingKind
    sampling_rate: float
    dataset_size: int
    batch_size: int | None = None
    unit: str = "example"
    #: DP-FTRL ledgers written before the tree aggregation mechanism stated its own charge
    #: (:meth:`TreeAggregationMechanism.step_event`): the tree nodes able to hold one example's
    #: gradient that the step newly released. Read back from such ledgers only; new records
    #: describe sampling alone and carry 0.
    tree_nodes: int = 0
    #: Balls-in-bins steps only: whether the step opened its epoch (and is charged the epoch's
    #: Gaussian) — set per step by :meth:`at_epoch_position`; None on the plan's record.
    epoch_start: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SamplingKind.parse(self.kind))
        if self.unit not in SAMPLING_UNITS:
            raise ValueError(
                f"sampling unit must be one of {', '.join(SAMPLING_UNITS)}; got {self.unit!r}"
            )
        object.__setattr__(self, "sampling_rate", check_sampling_rate(self.sampling_rate))
        object.__setattr__(self, "tree_nodes", check_count("tree_nodes", self.tree_nodes))
        if self.tree_nodes and self.kind not in TREE_KINDS:
            raise ValueError(f"a {self.kind.value} record releases no tree nodes; pass 0")
        if self.epoch_start is not None and (
            self.kind is not SamplingKind.BALLS_IN_BINS or not isinstance(self.epoch_start, bool)
        ):
            raise ValueError("epoch_start belongs to balls-in-bins steps (True or False)")
        object.__setattr__(
            self, "dataset_size", check_count("dataset_size", self.dataset_size, minimum=1)
        )
        if self.kind in POISSON_KINDS:
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
    def batches_per_epoch(self) -> int:
        """k = N // B: the batches an epoch of balls-in-bins (or shuffled batches) holds."""
        return self.dataset_size // (self.batch_size or 1)

    def at_epoch_position(self, position: int | None) -> SamplingRecord:
        """This record for a step at 0-based ``position`` in its epoch: a balls-in-bins step
        states whether it opened its epoch (the step charged the epoch's cost); others as is."""
        if self.kind is not SamplingKind.BALLS_IN_BINS:
            return self
        if position is None:
            raise ValueError("a balls-in-bins step needs its place in the epoch")
        return dataclasses.replace(self, epoch_start=position == 0)

    def run_event(self, noise_multiplier: float, steps: int) -> DpEvent:
        """The event of ``steps`` steps drawn this way, from the first (what σ is planned on)."""
        if self.kind is SamplingKind.BALLS_IN_BINS:
            epochs = math.ceil(steps / self.batches_per_epoch)
            return SelfComposedEvent(self._epoch_event(noise_multiplier), epochs)
        return SelfComposedEvent(self.event(noise_multiplier), steps)

    @property
    def max_batch_size(self) -> int | None:
        """M, the rows of every padded batch (truncated Poisson only; else None)."""
        return self.batch_size if self.kind is SamplingKind.TRUNCATED_POISSON else None

    @property
    def assumption_met(self) -> bool:
        """Whether :meth:`event` describes what the sampler really did (False for shuffling)."""
        return self.kind is not SamplingKind.SHUFFLE  # tree kinds assume no sampling at all

    @property
    def description(self) -> str:
        """The report sentence for this kind of sampling (and unit)."""
        if self.unit == "user" and self.kind is SamplingKind.POISSON:
            return _USER_POISSON
        return self.kind.description

    def event(self, noise_multiplier: float) -> DpEvent:
        """The event accounted for one DP-SGD step with noise multiplier σ.

        Poisson and shuffle both give ``PoissonSampledEvent(q, GaussianEvent(σ))`` — for the
        shuffle sampler that is an assumption not met, and :attr:`assumption_met` says so.
        Fixed-size sampling gives its honest ``FixedSizeSampledEvent``. A kind of
        :data:`MECHANISM_ACCOUNTED_KINDS` has no event of its own (ValueError): its noise
        mechanism states what each step is charged.
        """
        if self.kind in MECHANISM_ACCOUNTED_KINDS:
            raise ValueError(
                f"a {self.kind.value!r} record describes how the batches were taken only: the "
                "privacy event of each step comes from the noise mechanism (its participation "
                "schema), so a StepRecord of this kind needs the mechanism's event"
            )
        if self.kind in TREE_KINDS:
            return tree_step_event(noise_multiplier, self.tree_nodes)
        if self.kind is SamplingKind.BALLS_IN_BINS:
            if self.epoch_start is None:
                raise ValueError(
                    "a balls-in-bins step is charged by its place in the epoch: take the step's "
                    "record from at_epoch_position"
                )
            return self._epoch_event(noise_multiplier) if self.epoch_start else NoOpEvent()
        if self.kind is SamplingKind.TRUNCATED_POISSON:
            return TruncatedPoissonSampledEvent(
                self.sampling_rate,
                self.dataset_size,
                self.batch_size,
                GaussianEvent(noise_multiplier),
            )
        if self.kind is SamplingKind.FIXED_SIZE:
            return FixedSizeSampledEvent(
                self.dataset_size, self.batch_size, GaussianEvent(noise_multiplier)
            )
        return self.poisson_event(noise_multiplier)

    def _epoch_event(self, noise_multiplier: float) -> DpEvent:
        """A balls-in-bins epoch, charged in full (a partial last epoch too): 1 of k steps."""
        return BallsInBinsEpochEvent(noise_multiplier, self.batches_per_epoch)

    def poisson_event(self, noise_multiplier: float) -> DpEvent:
        """The event this step would be under Poisson sampling at the same q (for comparison).

        A DP-FTRL step's accounting uses no sampling, so Poisson sampling would change nothing.
        Batches whose event the mechanism supplies have no such figure (ValueError).
        """
        if self.kind in MECHANISM_ACCOUNTED_KINDS:
            raise ValueError(
                f"{self.kind.value!r} batches are accounted with their correlated noise by its "
                "participation schema, which the Poisson assumption would not change"
            )
        if self.kind in TREE_KINDS:
            return self.event(noise_multiplier)
        return PoissonSampledEvent(self.sampling_rate, GaussianEvent(noise_multiplier))

    def to_dict(self) -> dict[str, object]:
        """Plain-JSON form, for ledgers and reports (``unit`` only when it is not "example")."""
        data: dict[str, object] = {
            "kind": self.kind.value,
            "sampling_rate": self.sampling_rate,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
        }
        if self.unit != "example":
            data["unit"] = self.unit
        if self.kind in TREE_KINDS:
            data["tree_nodes"] = self.tree_nodes
        if self.epoch_start is not None:
            data["epoch_start"] = self.epoch_start
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SamplingRecord:
        """Inverse of :meth:`to_dict`; validation errors are ValueErrors."""
        if not isinstance(data, dict):
            raise ValueError(f"a sampling record must be a dict, got {type(data).__name__}")
        unknown = set(data) - {
            "kind", "sampling_rate", "dataset_size", "batch_size", "unit", "tree_nodes",
            "epoch_start",
        }  # fmt: skip
        if unknown:
            raise ValueError(f"unknown sampling record fields: {sorted(unknown)}")
        try:
            return cls(
                kind=data["kind"],
                sampling_rate=data["sampling_rate"],
                dataset_size=data["dataset_size"],
                batch_size=data.get("batch_size"),
                unit=data.get("unit", "example"),
                tree_nodes=data.get("tree_nodes", 0),
                epoch_start=data.get("epoch_start"),
            )
        except KeyError as missing:
            raise ValueError(f"sampling record lacks the field {missing}") from None
        except TypeError as err:
            raise ValueError(f"malformed sampling record: {err}") from None


def tree_step_event(noise_multiplier: float, nodes: int) -> DpEvent:
    """A DP-FTRL step: one Gaussian per newly released node that can hold an example's gradient.

    Summed over a tree these give the tree-aggregation bound of Kairouz et al. 2021 (App. D):
    ⌈log₂(T+1)⌉ Gaussians of noise σ, i.e. one Gaussian of noise σ/√depth.
    """
    if nodes == 0:
        return NoOpEvent()
    event = GaussianEvent(noise_multiplier)
    return event if nodes == 1 else SelfComposedEvent(event, nodes)


#: The orders make_private offers for DP-FTRL, by the name users pass as ``sampler``.
ORDERS = {
    "shuffle": SamplingKind.TREE_SHUFFLE,
    "tree-shuffle": SamplingKind.TREE_SHUFFLE,
    "fixed-order": SamplingKind.TREE_FIXED_ORDER,
    "tree-fixed-order": SamplingKind.TREE_FIXED_ORDER,
}


def parse_order(sampler: SamplingKind | str | None) -> SamplingKind:
    """The DP-FTRL order for ``sampler``; Poisson or fixed-size subsampling is refused with why."""
    if sampler is None:
        return SamplingKind.TREE_SHUFFLE
    name = sampler.value if isinstance(sampler, SamplingKind) else str(sampler).strip().lower()
    if name in ORDERS:
        return ORDERS[name]
    raise ValueError(
        f"DP-FTRL takes batches in order, each example once per epoch, and is accounted with no "
        f"sampling assumption, so sampler={name!r} has no meaning for it: choose "
        "sampler='shuffle' or 'fixed-order' (or train with DP-SGD to use Poisson sampling)"
    )
