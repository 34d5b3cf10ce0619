"""A torch DataLoader whose batches come from a DP sampler, empty batches included.

``DPDataLoader`` is a plain ``torch.utils.data.DataLoader`` (workers, pinning and the rest work as
usual) built on one of the samplers of :mod:`dpfy.data.sampling`. An empty Poisson batch is still
a DP-SGD step, so instead of crashing in ``collate([])`` it yields tensors shaped like a real batch
with zero rows. Every batch it hands out is published to its
:class:`~dpfy.data.provenance.Provenance`, which the private optimizer checks each step against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from dpfy._validate import check_count
from dpfy.data.batches import batch_length, holds_batches
from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.collate_probe import Collated, LastDrawn, ProbingCollate
from dpfy.data.microbatches import MicrobatchSlots
from dpfy.data.padding import Padding
from dpfy.data.provenance import Provenance
from dpfy.data.randomness import SecureSource, TorchSource
from dpfy.data.sampling import DpBatchSampler, check_batch_size, epoch_length, make_sampler
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.sampling import SamplingKind, SamplingRecord

_RESERVED = ("batch_size", "shuffle", "batch_sampler", "drop_last")


class PlanComplete(RuntimeError):
    """The loader has handed out every step of its run; another pass would exceed the plan."""


class DPDataLoader(DataLoader):
    """Batches drawn by a DP sampler; q = B/N from the dataset size and expected batch size.

    One pass over the loader is one epoch of N / B steps, as with any torch DataLoader, so
    the usual ``for epoch in range(E): for batch in loader`` loop works. ``steps`` (or
    ``epochs``, ``steps = ⌈E · N / B⌉``) bounds the run: the last pass may be shorter, and a pass
    beyond the bound raises :class:`PlanComplete` rather than drawing steps nobody planned.
    Without either the stream is unbounded (whoever steps on it accounts each step).
    ``microbatch_size=k`` draws each example's microbatch independently
    (:mod:`dpfy.data.microbatches`) and publishes it with the batch, for microbatch clipping.
    ``sampler="truncated-poisson"`` with ``max_batch_size=M`` yields every batch with exactly M
    rows, its padding rows marked (:mod:`dpfy.data.padding`).
    ``generator`` drives the sampler; ``worker_generator`` is torch's DataLoader ``generator``,
    which seeds worker processes (e.g. their augmentations) and never decides a batch.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        steps: int | None = None,
        epochs: float | None = None,
        sampler: SamplingKind | str | DpBatchSampler = SamplingKind.POISSON,
        generator: torch.Generator | None = None,
        secure: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        microbatch_size: int | None = None,
        worker_generator: torch.Generator | None = None,
        behaviour_checks: CheckSchedule | None = None,
        max_batch_size: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        dataset_size = dataset_size_of(dataset)
        batch_size = check_batch_size(dataset_size, batch_size)
        for name in (*_RESERVED, "sampler"):
            if name in dataloader_kwargs:
                raise ValueError(f"DPDataLoader chooses {name} itself; do not pass it")
        per_epoch = epoch_length(dataset_size, batch_size)
        total = _resolve_total(steps, epochs, per_epoch)
        if isinstance(sampler, DpBatchSampler):  # built by the caller (e.g. a rank's shard)
            batch_sampler = _own_sampler(sampler, dataset_size, total)
        else:
            batch_sampler = make_sampler(
                sampler, dataset_size, batch_size, per_epoch, generator, secure=secure,
                total=total, max_batch_size=max_batch_size,
            )  # fmt: skip
        collate = collate_fn if collate_fn is not None else default_collate
        self.check_schedule = behaviour_checks if behaviour_checks is not None else CheckSchedule()
        super().__init__(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=ProbingCollate(
                EmptyBatchCollate(collate, empty_batch_like(collate, dataset)),
                self.check_schedule,
                LastDrawn(batch_sampler),  # a padded batch: its padding rows are never probed
            ),
            generator=worker_generator,  # seeds worker processes only; never the sampling
            **dataloader_kwargs,
        )
        self.expected_batch_size = batch_size
        self._consumed = 0  # batches handed out since the run began
        self.provenance = Provenance()
        self.microbatches = (
            None
            if microbatch_size is None
            else MicrobatchSlots(batch_size, microbatch_size, _unit_source(generator, secure))
        )

    @property
    def dp_sampler(self) -> DpBatchSampler:
        """The sampler drawing the batches (also ``self.batch_sampler``)."""
        return self.batch_sampler

    @property
    def sampling_rate(self) -> float:
        """q = B/N."""
        return self.dp_sampler.sampling_rate

    @property
    def sampling_record(self) -> SamplingRecord:
        """How batches are drawn, for the ledger and report."""
        return self.dp_sampler.record

    def step_event(self, noise_multiplier: float) -> DpEvent:
        """The event one step accounts at noise multiplier σ."""
        return self.dp_sampler.step_event(noise_multiplier)

    @property
    def steps_per_epoch(self) -> int | Fraction:
        """The steps of one pass: N / B expected (pass k ends at ⌈k · N/B⌉), or whole batches."""
        return self.dp_sampler.steps

    @property
    def total_steps(self) -> int | None:
        """The run's steps over all passes (None: unbounded)."""
        return self.dp_sampler.total

    @property
    def epochs(self) -> int | None:
        """The passes the run takes, the last one possibly short (None: unbounded)."""
        return self.dp_sampler.passes

    @property
    def epoch(self) -> int:
        """The 0-based pass the next iteration runs, or continues if it was left part-way."""
        return self.dp_sampler.pass_index(self._consumed)

    @property
    def steps_taken(self) -> int:
        """Batches handed out so far, over all passes."""
        return self._consumed

    def __iter__(self) -> Iterator[Any]:
        """One pass (epoch) as DataLoader does, publishing each batch as it is handed out."""
        total = self.total_steps
        if total is not None and self._consumed >= total:
            raise PlanComplete(
                f"this loader has handed out all {total} planned steps ({self.epochs} epochs); "
                "the run is complete. Loop over "
                "`range(loader.epochs)` passes, or plan more epochs or steps (each one spends "
                "privacy)"
            )
        self.dp_sampler.rewind(self._consumed)  # a pass left early: redraw what workers drew
        for batch in super().__iter__():
            self._consumed += 1
            yield self._publish(batch)

    def _publish(self, collated: Collated) -> Any:
        """Tell the run which batch is in hand (size, clipping units, place in its epoch)."""
        batch = collated.batch
        size = batch_length(batch)
        padding = self.dp_sampler.padding(self._consumed)
        if padding is not None:  # a static-shape batch: its examples are its first rows
            if size != padding.rows:
                raise ValueError(
                    f"the sampler drew {padding.rows} rows but collate_fn returned {size}; a "
                    "padded batch needs a collate_fn that keeps one row per index"
                )
            size = padding.real
        units = None if self.microbatches is None else self.microbatches.draw(size)
        unit = "example" if units is None else "microbatch"
        self._announce(size, units, unit, collated.verdict, padding)
        self.provenance.hold(batch)
        return batch

    def _announce(
        self,
        size: int,
        units: torch.Tensor | None,
        unit: str,
        collate_probe: tuple[str, str] | None = None,
        padding: Padding | None = None,
    ) -> None:
        """Publish one batch handed out, with its place in the epoch as the sampler cut it."""
        position = self.dp_sampler.epoch_position(self._consumed)
        self.provenance.publish(size, units, position, unit, collate_probe, padding)

    def state_dict(self) -> dict[str, Any]:
        """The sampler state as of the batches stepped on (not those prefetched by workers).

        A batch handed out but not stepped on yet (a checkpoint taken mid-batch) is drawn
        again on resume, so the resumed run steps on exactly the batches this one would have.
        """
        back = 1 if self.provenance.pending == 1 and self._consumed >= 1 else 0
        state = self.dp_sampler.state_dict(position=self._consumed - back)
        state["provenance"] = self.provenance.state_dict(back)
        if self.microbatches is not None:
            state["microbatches"] = self.microbatches.state_dict(back=bool(back))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next pass continues where the checkpointed one stopped."""
        if not isinstance(state, dict):
            raise ValueError(f"loader state must be a dict, got {type(state).__name__}")
        if (self.microbatches is None) != ("microbatches" not in state):
            raise ValueError("the checkpoint and this loader disagree on microbatch clipping")
        provenance = Provenance()
        provenance.load_state_dict(state.get("provenance"))  # validated before any change
        self.dp_sampler.load_state_dict(state)
        if self.microbatches is not None:
            self.microbatches.load_state_dict(state["microbatches"])
        self.provenance.load_state_dict(provenance.state_dict())
        self._consumed = self.dp_sampler.position


def rest_of_run(loader: DPDataLoader) -> Iterator[Any]:
    """Every batch the run still holds, epoch after epoch: a bounded loader's whole plan."""
    if loader.epochs is None:
        raise ValueError("the loader is unbounded (no steps or epochs): loop over its epochs")
    for _ in range(loader.epoch, loader.epochs):
        yield from loader


def checked_loader_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """DataLoader options a private run may take; those that decide the sampling are refused."""
    options = dict(options or {})
    chosen = sorted(set(options) & {*_RESERVED, "sampler", "generator", "secure", "steps",
                                    "epochs", "microbatch_size"})  # fmt: skip
    if chosen:
        raise ValueError(
            f"loader_options may not set {', '.join(chosen)}: the private run draws its batches "
            "itself (Poisson, or the sampler you chose); pass DataLoader options such as "
            "num_workers, pin_memory, collate_fn or worker_generator (it seeds workers) only"
        )
    return options


class EmptyBatchCollate:
    """Collate non-empty batches as usual; answer an empty one with a zero-row template.

    A class rather than a closure so that worker processes can pickle it.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any], empty: Any) -> None:
        self.collate_fn = collate_fn
        self.empty = empty

    def __call__(self, samples: list[Any]) -> Any:
        if len(samples) == 0:
            return _clone_structure(self.empty)
        return self.collate_fn(samples)


def empty_batch_like(collate_fn: Callable[[list[Any]], Any], dataset: Dataset) -> Any:
    """The batch of zero examples: ``collate([dataset[0]])`` with its batch dimension cut to 0.

    Reads ``dataset[0]`` once, for its shapes and dtypes only; every example is assumed to share
    them (a padding collate gets the width of example 0). Tensors, numpy arrays, numbers, strings
    and tuples, lists, dicts or namedtuples of them are supported.
    """
    try:
        one = collate_fn([dataset[0]])
    except Exception as err:
        raise ValueError(
            f"could not collate dataset[0] to learn the batch shape for empty batches: {err}"
        ) from err
    return _cut_to_zero(one)


def _cut_to_zero(value: Any) -> Any:
    """Keep the structure and trailing shapes, drop every row."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(
                "the collated batch holds a 0-d tensor, which has no batch dimension to empty; "
                "return batch-first tensors from collate_fn"
            )
        return value[:0].clone()
    if isinstance(value, Mapping):
        return type(value)({k: _cut_to_zero(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_cut_to_zero(v) for v in value))
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if isinstance(value, list) and value and not holds_batches(value):
            return []  # a list of per-example items (e.g. strings): empty list
        return type(value)(_cut_to_zero(v) for v in value)
    raise ValueError(
        f"cannot build an empty batch from a collated {type(value).__name__}; make collate_fn "
        "return batch-first tensors (or containers of them)"
    )


def _unit_source(generator: torch.Generator | None, secure: bool) -> SecureSource | TorchSource:
    """Randomness for clipping units: the OS CSPRNG when sampling is secure, else a generator.

    Seeded runs derive its seed from the sampling generator, so they stay reproducible.
    """
    if secure:
        return SecureSource()
    if generator is None:
        return TorchSource()
    seed = int(torch.randint(2**62, (1,), generator=generator))
    return TorchSource(torch.Generator().manual_seed(seed))


def _clone_structure(value: Any) -> Any:
    """A fresh copy of the template so callers may modify what they receive."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, Mapping):
        return type(value)({k: _clone_structure(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_clone_structure(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_structure(v) for v in value)
    return value


def dataset_size_of(dataset: Dataset) -> int:
    """The number of examples N; an iterable or empty dataset is refused with the fix."""
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "DP sampling needs random access to the examples; pass a map-style Dataset "
            "(one with __len__ and __getitem__), not an IterableDataset"
        )
    try:
        size = len(dataset)
    except TypeError:
        raise ValueError("the dataset must define __len__ so q = B/N can be computed") from None
    if size == 0:
        raise ValueError("the dataset is empty: add examples before building a DPDataLoader")
    return size


def _resolve_total(
    steps: int | None, epochs: float | None, per_epoch: int | Fraction
) -> int | None:
    """The run's steps from ``steps`` or ``epochs`` (not both); unbounded without either."""
    if steps is not None and epochs is not None:
        raise ValueError("pass steps or epochs, not both")
    if steps is not None:
        return check_count("steps", steps, minimum=1)
    if epochs is None:
        return None
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise ValueError(f"epochs must be a number > 0, got {epochs!r}")
    if not math.isfinite(epochs):
        raise ValueError("epochs must be finite; pass the number of passes the run takes")
    return max(1, math.ceil(epochs * float(per_epoch)))  # as the plan computes ⌈E · N/B⌉


def _own_sampler(sampler: DpBatchSampler, dataset_size: int, total: int | None) -> DpBatchSampler:
    """A sampler built by the caller (e.g. a rank's shard) fixes its own passes and length."""
    if sampler.dataset_size != dataset_size:
        raise ValueError(
            f"the sampler draws from {sampler.dataset_size} examples but the dataset has "
            f"{dataset_size}; build the sampler for this dataset"
        )
    if total is not None:
        raise ValueError(
            "a sampler passed in fixes the run's length itself (its total); do not also pass "
            "steps or epochs to the loader"
        )
    return sampler
