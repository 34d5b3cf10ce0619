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


class ShuffleSampler(DpBatchSampler):
    """Shuffle once per epoch and cut the permutation into ``N // B`` batches of exactly B.

    The ``N mod B`` examples left at the end of a permutation are skipped that epoch. Not
    Poisson: it is accounted under the Poisson assumption and the record says that assumption is
    not met (guide §4.3). The permutation carries across passes, so every example is seen once per
    epoch however the passes are cut.
    """

    kind = SamplingKind.SHUFFLE

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.batch_size = check_batch_size(dataset_size, batch_size)
        self._permutation: torch.Tensor | None = None
        self._offset = 0  # batches already cut from the current permutation
        if steps is None:
            steps = dataset_size // self.batch_size
        super().__init__(dataset_size, steps, generator, secure=secure, total=total)

    @property
    def batches_per_epoch(self) -> int:
        """N // B full batches per permutation."""
        return self.dataset_size // self.batch_size

    def epoch_position(self, position: int) -> int:
        """Read from the permutation's offset once that batch was cut (workers may draw ahead)."""
        return int(self._snapshot_at(position)["offset"]) - 1

    @property
    def record(self) -> SamplingRecord:
        """Shuffled batches, accounted as Poisson at q = B/N with the assumption flagged unmet."""
        return SamplingRecord(
            SamplingKind.SHUFFLE,
            self.batch_size / self.dataset_size,
            self.dataset_size,
            self.batch_size,
        )

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
        permutation, offset = state["permutation"], check_count("offset", state["offset"])
        if permutation is not None:
            if not isinstance(permutation, torch.Tensor) or permutation.shape != (
                self.dataset_size,
            ):
                raise ValueError(f"permutation must be a tensor of {self.dataset_size} indices")
            permutation = permutation.to(torch.int64)
        if offset > self.batches_per_epoch:
            raise ValueError(f"offset {offset} exceeds {self.batches_per_epoch} batches per epoch")
        self._permutation, self._offset = permutation, offset


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
) -> DpBatchSampler:
    """Build a sampler by kind name ('poisson', 'shuffle', 'fixed-size'); passes of ``steps``."""
    kind = SamplingKind.parse(kind)
    if kind is SamplingKind.POISSON:
        return PoissonSampler.from_batch_size(
            dataset_size, batch_size, steps, generator, secure=secure, total=total
        )
    cls = ShuffleSampler if kind is SamplingKind.SHUFFLE else FixedSizeSampler
    return cls(dataset_size, batch_size, steps, generator, secure=secure, total=total)
