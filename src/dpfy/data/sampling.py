"""Batch samplers that draw indices the way the accountant assumes, and say how they drew them.

:class:`PoissonSampler` is the default and the only one whose accounting assumption is met at
every step (guide alg. 1, §4.3): each index joins each batch independently with probability
q = B/N, batch sizes vary, and an empty batch is yielded as ``[]`` — it is still a step, and
it is accounted. :class:`ShuffleSampler` and :class:`FixedSizeSampler` exist only as explicit
choices and their :class:`~dpfy.plan.sampling.SamplingRecord` says plainly that they are not
Poisson.

A sampler is a stream of batches cut into passes of ``steps`` batches (a loader's epochs): each
iteration yields the rest of the current pass and the next continues the same random stream.
``steps`` may be a fraction, as an epoch of N/B expected steps is: pass k then ends at step
⌈k · steps⌉, so E passes hold exactly the ⌈E · N/B⌉ steps a plan of E epochs takes.
``total`` bounds the stream (a run's planned steps; the last pass may be shorter), ``None``
leaves it unbounded. ``state_dict()`` / ``load_state_dict()`` capture the stream and its
position, so a resumed run draws the very batches an uninterrupted one would have drawn.
"""

from __future__ import annotations

import abc
import collections
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch.utils.data import Sampler

from dpfy._validate import check_count, check_sampling_rate
from dpfy.data.padding import PAD_INDEX, Padding
from dpfy.data.randomness import RandomSource, make_source
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.sampling import SamplingKind, SamplingRecord

_STATE_VERSION = 2  # 2: positions count the whole stream, not one pass

# How many recent positions a sampler can still report state for. A DataLoader with workers
# draws batches ahead of the ones it has handed out (num_workers × prefetch_factor), so the
# loader asks for the state as of the batches *consumed*, which may lie a little behind.
_HISTORY = 1024


class DpBatchSampler(Sampler[list[int]], abc.ABC):
    """Shared machinery: passes of ``steps`` batches, a random source, resumable snapshots."""

    kind: ClassVar[SamplingKind]

    def __init__(
        self,
        dataset_size: int,
        steps: int | Fraction,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.dataset_size = check_count("dataset_size", dataset_size, minimum=1)
        self.steps = check_pass_length(steps)
        self.total = None if total is None else check_count("total", total, minimum=1)
        self._source: RandomSource = make_source(generator, secure)
        self._position = 0  # batches drawn from the whole stream
        self._history: collections.deque[dict[str, Any]] = collections.deque(maxlen=_HISTORY)
        self._history.append(self._snapshot())

    # -- what the sampler tells the ledger -----------------------------------------------------
    @property
    @abc.abstractmethod
    def record(self) -> SamplingRecord:
        """How this sampler draws batches."""

    def step_event(self, noise_multiplier: float) -> DpEvent:
        """The event the ledger accounts for one step at noise multiplier σ."""
        return self.record.event(noise_multiplier)

    @property
    def sampling_rate(self) -> float:
        """q, from the dataset size and the (expected) batch size."""
        return self.record.sampling_rate

    def epoch_position(self, position: int) -> int | None:
        """The place (0-based) in its epoch of the pass's batch ``position`` (None: no epochs)."""
        return None

    def padding(self, position: int) -> Padding | None:
        """Which rows of batch ``position`` are examples, for samplers that pad (else None)."""
        return None

    @property
    def position(self) -> int:
        """Batches drawn so far from the stream (workers may draw ahead of the consumer)."""
        return self._position

    @property
    def remaining(self) -> int | None:
        """Batches the stream still holds (None: unbounded)."""
        return None if self.total is None else self.total - self._position

    @property
    def secure(self) -> bool:
        """Whether decisions come from the OS CSPRNG."""
        return self._source.secure

    # -- iteration -----------------------------------------------------------------------------
    def __len__(self) -> int:
        """The batches the next iteration yields: the rest of the current pass."""
        return self._pass_end() - self._position

    def _pass_end(self) -> int:
        """Where the current pass ends: its boundary, or the end of a bounded stream."""
        end = math.ceil((self._position // self.steps + 1) * self.steps)
        return end if self.total is None else min(end, self.total)

    @property
    def passes(self) -> int | None:
        """The passes a bounded stream takes (the last may be short); None when unbounded."""
        if self.total is None:
            return None
        return int((self.total - 1) // self.steps) + 1  # the first k with ⌈k · steps⌉ ≥ total

    def pass_index(self, position: int) -> int:
        """The 0-based pass that batch ``position`` + 1 of the stream belongs to."""
        return int(position // self.steps)

    def __iter__(self) -> Iterator[list[int]]:
        """Yield the rest of the current pass (a resumed stream continues its interrupted pass)."""
        end = self._pass_end()
        while self._position < end:
            batch = self._draw().tolist()
            self._position += 1
            self._history.append(self._snapshot())
            yield batch

    def rewind(self, position: int) -> None:
        """Go back to just after batch ``position``: batches drawn ahead are drawn again, equal.

        A DataLoader's workers draw a few batches before they are handed out; when a pass is
        left early, the loader rewinds to what it handed out, so no batch is skipped.
        """
        if position == self._position:
            return
        snapshot = self._snapshot_at(position)
        self._source.set_state(snapshot["rng"])
        self._restore_context(snapshot)
        self._position = position
        while self._history[-1]["position"] != position:
            self._history.pop()

    @abc.abstractmethod
    def _draw(self) -> torch.Tensor:
        """The next batch's indices."""

    # -- checkpoints ---------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        """Everything needed to continue from the current position."""
        return {"position": self._position, "rng": self._source.get_state(), **self._context()}

    def _context(self) -> dict[str, Any]:
        """Sampler-specific stream state beyond the random source (e.g. the epoch permutation)."""
        return {}

    def _restore_context(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`_context`; validates what it reads."""

    def _identity(self) -> dict[str, Any]:
        """The configuration a checkpoint must match to be loaded here."""
        return {
            "kind": self.kind.value,
            "dataset_size": self.dataset_size,
            "steps": str(self.steps),  # a fraction, as text: checkpoints hold plain values
            "total": self.total,
            "sampling_rate": self.sampling_rate,
            "secure": self.secure,
        }

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """The stream state after ``position`` batches of the stream (default: all drawn).

        ``position`` lets a DataLoader that prefetches report the state as of the batches it has
        actually handed out; it must be one of the last ~1000 positions drawn.
        """
        snapshot = self._history[-1] if position is None else self._snapshot_at(position)
        state = {"version": _STATE_VERSION, **self._identity(), **snapshot}
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def _snapshot_at(self, position: int) -> dict[str, Any]:
        """The stream state just after batch ``position`` of the stream was drawn."""
        for snapshot in reversed(self._history):
            if snapshot["position"] == position:
                return snapshot
        drawn = [s["position"] for s in self._history]
        raise ValueError(
            f"no sampler state for position {position} of the stream "
            f"(known: {drawn[0]}..{drawn[-1]})"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the stream: the next iteration continues the interrupted pass.

        Refuses (ValueError, nothing changed) a state written by a sampler of another kind,
        dataset size, rate, pass length, stream length or randomness source.
        """
        if not isinstance(state, dict):
            raise ValueError(f"sampler state must be a dict, got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unsupported sampler state version {state.get('version')!r} "
                f"(this dpfy reads version {_STATE_VERSION})"
            )
        for key, mine in self._identity().items():
            if state.get(key) != mine:
                raise ValueError(
                    f"sampler state mismatch: checkpoint has {key}={state.get(key)!r}, this "
                    f"sampler has {key}={mine!r}; build the sampler with the checkpoint's settings"
                )
        saved_rng, saved_context = self._source.get_state(), self._context()
        try:
            position = check_count("position", state["position"])
            if self.total is not None and position > self.total:
                raise ValueError(f"position {position} exceeds the stream's {self.total} batches")
            self._source.set_state(state["rng"])
            self._restore_context(state)
        except (ValueError, TypeError, KeyError, RuntimeError) as err:
            self._source.set_state(saved_rng)
            self._restore_context(saved_context)
            raise ValueError(f"corrupt sampler state: {err}") from None
        self._position = position
        self._history.clear()
        self._history.append(self._snapshot())


class PoissonSampler(DpBatchSampler):
    """Each step, every index joins the batch independently with probability q (guide alg. 1).

    Batch sizes are Binomial(N, q); an empty batch is yielded as ``[]``, never skipped. Build it
    from the expected batch size with :meth:`from_batch_size` (q = B/N), not from a loader length.
    """

    kind = SamplingKind.POISSON

    def __init__(
        self,
        dataset_size: int,
        sampling_rate: float,
        steps: int | Fraction,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self._sampling_rate = check_sampling_rate(sampling_rate)
        super().__init__(dataset_size, steps, generator, secure=secure, total=total)

    @classmethod
    def from_batch_size(
        cls,
        dataset_size: int,
        expected_batch_size: int,
        steps: int | Fraction,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> PoissonSampler:
        """q = B/N from the dataset size and the expected batch size."""
        return cls(
            dataset_size,
            sampling_rate_for(dataset_size, expected_batch_size),
            steps,
            generator,
            secure=secure,
            total=total,
        )

    @property
    def expected_batch_size(self) -> float:
        """qN, the batch size DP-SGD divides by."""
        return self._sampling_rate * self.dataset_size

    @property
    def record(self) -> SamplingRecord:
        """Poisson at rate q: the accounting assumption is met."""
        return SamplingRecord(SamplingKind.POISSON, self._sampling_rate, self.dataset_size)

    def _draw(self) -> torch.Tensor:
        return self._source.bernoulli_indices(self.dataset_size, self._sampling_rate)


class TruncatedPoissonSampler(PoissonSampler):
    """Poisson at rate q, cut to at most M indices and padded to exactly M (static shapes).

    Each step draws a Poisson sample; a sample of more than M keeps M of them uniformly at
    random (so which examples are dropped is independent of the data); the batch is then padded
    with copies of ``dataset[PAD_INDEX]`` up to M rows, the examples first. :meth:`padding`
    says how many rows of each batch are examples, and the private step gives every padding row
    a weight of exactly 0 (:mod:`dpfy.data.padding`). Accounted as Poisson at q with the chance
    of a cut charged in δ (:mod:`dpfy.plan.accounting.truncation`).
    """

    kind = SamplingKind.TRUNCATED_POISSON

    def __init__(
        self,
        dataset_size: int,
        sampling_rate: float,
        max_batch_size: int,
        steps: int | Fraction,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.max_batch_size = check_batch_size(dataset_size, max_batch_size)
        self._real = 0  # examples in the batch drawn last
        super().__init__(dataset_size, sampling_rate, steps, generator, secure=secure, total=total)

    @property
    def record(self) -> SamplingRecord:
        """Truncated Poisson at rate q, cap M: the accounting assumption is met."""
        return SamplingRecord(
            SamplingKind.TRUNCATED_POISSON,
            self._sampling_rate,
            self.dataset_size,
            self.max_batch_size,
        )

    def padding(self, position: int) -> Padding:
        """The examples of batch ``position`` (the first rows) and its M rows."""
        return Padding(self.max_batch_size, int(self._snapshot_at(position)["real"]))

    def _draw(self) -> torch.Tensor:
        drawn = self._source.bernoulli_indices(self.dataset_size, self._sampling_rate)
        if drawn.numel() > self.max_batch_size:  # keep M of them, chosen independently of data
            drawn = drawn[self._source.choice(int(drawn.numel()), self.max_batch_size)]
        self._real = int(drawn.numel())
        pad = torch.full((self.max_batch_size - self._real,), PAD_INDEX, dtype=drawn.dtype)
        return torch.cat([drawn, pad])

    def _identity(self) -> dict[str, Any]:
        return {**super()._identity(), "max_batch_size": self.max_batch_size}

    def _context(self) -> dict[str, Any]:
        return {"real": self._real}

    def _restore_context(self, state: dict[str, Any]) -> None:
        real = check_count("real", state["real"])
        if real > self.max_batch_size:
            raise ValueError(f"{real} examples exceed the cap of {self.max_batch_size}")
        self._real = real


class FixedSizeSampler(DpBatchSampler):
    """Each step, ``batch_size`` distinct indices drawn uniformly without replacement.

    Not Poisson. Its honest event is ``FixedSizeSampledEvent``, which only the RDP accountant
    bounds, under replace-one adjacency.
    """

    kind = SamplingKind.FIXED_SIZE

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        steps: int | Fraction,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.batch_size = check_batch_size(dataset_size, batch_size)
        super().__init__(dataset_size, steps, generator, secure=secure, total=total)

    @property
    def record(self) -> SamplingRecord:
        """Fixed-size subsampling: honest event, valid under replace-one only."""
        return SamplingRecord(
            SamplingKind.FIXED_SIZE,
            self.batch_size / self.dataset_size,
            self.dataset_size,
            self.batch_size,
        )

    def _draw(self) -> torch.Tensor:
        return self._source.choice(self.dataset_size, self.batch_size)


class EpochBatchSampler(DpBatchSampler):
    """A sampler that deals the dataset out into k = N // B batches per epoch (each example in
    at most one batch of an epoch): what shuffling and balls-in-bins share.

    Subclasses draw an epoch's arrangement and cut it; ``_offset`` counts the batches already
    handed out from the current one.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        steps: int | Fraction | None = None,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.batch_size = check_batch_size(dataset_size, batch_size)
        self._offset = 0
        if steps is None:
            steps = dataset_size // self.batch_size
        super().__init__(dataset_size, steps, generator, secure=secure, total=total)

    @property
    def batches_per_epoch(self) -> int:
        """k = N // B batches per epoch."""
        return self.dataset_size // self.batch_size

    def epoch_position(self, position: int) -> int:
        """Read from the epoch's offset once that batch was cut (workers may draw ahead)."""
        return int(self._snapshot_at(position)["offset"]) - 1

    @property
    def record(self) -> SamplingRecord:
        """This kind of batches at q = B/N, with the batch size B."""
        return SamplingRecord(
            self.kind, self.batch_size / self.dataset_size, self.dataset_size, self.batch_size
        )

    def _checked_offset(self, offset: Any) -> int:
        """A restored offset: a count of at most k batches."""
        offset = check_count("offset", offset)
        if offset > self.batches_per_epoch:
            raise ValueError(f"offset {offset} exceeds {self.batches_per_epoch} batches per epoch")
        return offset


class ShuffleSampler(EpochBatchSampler):
    """Shuffle once per epoch and cut the permutation into ``N // B`` batches of exactly B.

    The ``N mod B`` examples left at the end of a permutation are skipped that epoch. Not
    Poisson: it is accounted under the Poisson assumption and the record says that assumption is
    not met (guide §4.3). The permutation carries across passes, so every example is seen once per
    epoch however the passes are cut.
    """

    kind = SamplingKind.SHUFFLE
    _permutation: torch.Tensor | None = None  # the epoch's permutation, once drawn

    def _draw(self) -> torch.Tensor:
        if self._permutation is None or self._offset >= self.batches_per_epoch:
            self._permutation = self._source.permutation(self.dataset_size)
            self._offset = 0
        start = self._offset * self.batch_size
        self._offset += 1
        return self._permutation[start : start + self.batch_size]

    def _context(self) -> dict[str, Any]:
        return {"permutation": self._permutation, "offset": self._offset}

    def _restore_context(self, state: dict[str, Any]) -> None:
        permutation, offset = state["permutation"], self._checked_offset(state["offset"])
        if permutation is not None:
            if not isinstance(permutation, torch.Tensor) or permutation.shape != (
                self.dataset_size,
            ):
                raise ValueError(f"permutation must be a tensor of {self.dataset_size} indices")
            permutation = permutation.to(torch.int64)
        self._permutation, self._offset = permutation, offset


class BallsInBinsSampler(EpochBatchSampler):
    """Each epoch, every example goes to one of the epoch's k = N // B batches, uniformly at
    random and independently of the others (balls-in-bins, Chua et al., AISTATS 2025).

    Batch sizes are Binomial(N, 1/k) (mean N/k ≈ B; an empty batch is yielded as ``[]``), and
    each example is in exactly one batch per epoch. The assignment of a new epoch is drawn when
    its first batch is. Accounted per epoch as random allocation of each example to 1 of k
    Gaussian steps (:mod:`dpfy.plan.accounting.random_allocation`), charged at the epoch's first
    step (:meth:`~dpfy.plan.sampling.SamplingRecord.at_epoch_position`).
    """

    kind = SamplingKind.BALLS_IN_BINS
    _order: torch.Tensor | None = None  # example indices sorted by their batch
    _bounds: torch.Tensor | None = None  # where each batch starts in _order (k + 1)

    def _draw(self) -> torch.Tensor:
        if self._order is None or self._offset >= self.batches_per_epoch:
            self._assign(self._source.integers(self.dataset_size, self.batches_per_epoch))
            self._offset = 0
        assert self._order is not None and self._bounds is not None
        start, stop = int(self._bounds[self._offset]), int(self._bounds[self._offset + 1])
        self._offset += 1
        return self._order[start:stop]

    def _assign(self, bins: torch.Tensor) -> None:
        """Each example's batch (0..k-1) → the examples in batch order and the batch bounds."""
        self._bins = bins
        self._order = torch.argsort(bins, stable=True)
        counts = torch.bincount(bins, minlength=self.batches_per_epoch)
        self._bounds = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    def _context(self) -> dict[str, Any]:
        bins = None if self._order is None else self._bins
        return {"bins": bins, "offset": self._offset}

    def _restore_context(self, state: dict[str, Any]) -> None:
        bins, offset = state["bins"], self._checked_offset(state["offset"])
        if bins is None:
            self._order = self._bounds = None
        else:
            if not isinstance(bins, torch.Tensor) or bins.shape != (self.dataset_size,):
                raise ValueError(f"bins must be a tensor of {self.dataset_size} batch numbers")
            bins = bins.to(torch.int64)
            if bool((bins < 0).any()) or bool((bins >= self.batches_per_epoch).any()):
                raise ValueError(f"bins must lie in 0..{self.batches_per_epoch - 1}")
            self._assign(bins)
        self._offset = offset


def check_pass_length(steps: int | Fraction) -> int | Fraction:
    """A pass holds a whole or fractional number of steps, at least one."""
    if isinstance(steps, Fraction):
        if steps < 1:
            raise ValueError(f"a pass must hold at least one step, got {steps}")
        return steps.numerator if steps.denominator == 1 else steps
    return check_count("steps", steps, minimum=1)


def epoch_length(dataset_size: int, batch_size: int) -> Fraction:
    """An epoch of Poisson sampling: N / B expected steps, kept exact."""
    return Fraction(check_count("dataset_size", dataset_size, minimum=1), batch_size)


def sampling_rate_for(dataset_size: int, batch_size: int) -> float:
    """q = B/N, with one clear error when the pair cannot describe a sampler."""
    return check_batch_size(dataset_size, batch_size) / check_count(
        "dataset_size", dataset_size, minimum=1
    )


def check_batch_size(dataset_size: int, batch_size: int) -> int:
    """A (expected) batch size must lie in [1, N]; the message names the fix."""
    dataset_size = check_count("dataset_size", dataset_size, minimum=0)
    if dataset_size == 0:
        raise ValueError("the dataset is empty: there is nothing to train on privately")
    try:
        batch_size = check_count("batch_size", batch_size, minimum=1)
    except ValueError:
        raise ValueError(
            f"batch_size must be a whole number of examples >= 1, got {batch_size!r}; pass the "
            "expected batch size B (the sampling rate is q = B/N)"
        ) from None
    if batch_size > dataset_size:
        raise ValueError(
            f"batch_size {batch_size} exceeds the dataset size {dataset_size}; lower batch_size "
            "to at most the number of examples"
        )
    return batch_size


def make_sampler(
    kind: SamplingKind | str,
    dataset_size: int,
    batch_size: int,
    steps: int | Fraction,
    generator: torch.Generator | None = None,
    *,
    secure: bool = False,
    total: int | None = None,
    max_batch_size: int | None = None,
) -> DpBatchSampler:
    """Build a sampler by kind name (those of :data:`SAMPLERS`); passes of ``steps``.

    ``max_batch_size`` is truncated Poisson's cap M (required there, refused elsewhere).
    """
    kind = SamplingKind.parse(kind)
    if kind not in SAMPLERS:
        raise ValueError(
            f"no batch sampler of kind {kind.value!r} here; choose one of "
            f"{', '.join(k.value for k in SAMPLERS)}"
        )
    if (kind is SamplingKind.TRUNCATED_POISSON) != (max_batch_size is not None):
        raise ValueError(
            "max_batch_size is truncated Poisson's cap: pass it with sampler='truncated-poisson' "
            "and only then"
        )
    options = {} if max_batch_size is None else {"max_batch_size": max_batch_size}
    return SAMPLERS[kind](
        dataset_size, batch_size, steps, generator, secure=secure, total=total, **options
    )


def _truncated(
    dataset_size: int,
    batch_size: int,
    steps: int | Fraction,
    generator: torch.Generator | None = None,
    *,
    secure: bool = False,
    total: int | None = None,
    max_batch_size: int,
) -> TruncatedPoissonSampler:
    """Truncated Poisson at q = B/N, cut to and padded to ``max_batch_size``."""
    return TruncatedPoissonSampler(
        dataset_size,
        sampling_rate_for(dataset_size, batch_size),
        max_batch_size,
        steps,
        generator,
        secure=secure,
        total=total,
    )


#: The batch samplers by the kind of sampling they do (each built from N, B and passes).
SAMPLERS: dict[SamplingKind, Any] = {
    SamplingKind.POISSON: PoissonSampler.from_batch_size,
    SamplingKind.TRUNCATED_POISSON: _truncated,
    SamplingKind.SHUFFLE: ShuffleSampler,
    SamplingKind.BALLS_IN_BINS: BallsInBinsSampler,
    SamplingKind.FIXED_SIZE: FixedSizeSampler,
}
