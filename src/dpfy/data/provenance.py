"""Which batch the private sampler drew last: the record a private step checks its batch against.

The accounting of a step assumes its batch is the one the run's sampler drew (Poisson at q, or
the declared order), used for exactly one step. Nothing in the training loop may assume that:
the loader *publishes* each batch it hands out as a :class:`DrawnBatch`, the engine stamps every
captured layer call with the number of the batch current at forward time, and the optimizer
refuses a step whose calls carry another stamp (a plain DataLoader's batch, two loader batches
accumulated into one step, a batch stepped on twice) or whose example count differs from the
drawn batch's (a hand-made slice).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from dpfy._validate import check_count
from dpfy.data.batches import batch_tensors
from dpfy.data.padding import Padding


@dataclasses.dataclass(frozen=True)
class DrawnBatch:
    """One batch as the loader handed it out: its number, size and clipping units.

    ``number`` counts the batches this loader has drawn since the run began (across passes and
    resumes). ``units`` holds one clipping-unit id per example, in batch order (user ids at user
    level, microbatch slots with microbatch clipping), or None: each example is its own unit.
    ``unit`` names what ``units`` holds ("example": nothing, "microbatch" or "user"), so that
    an optimizer never clips units it does not account for. ``epoch_position`` is the batch's
    0-based place in its epoch for samplers that take epochs in order (DP-FTRL's trees follow
    it), else None. ``padding`` marks a static-shape batch's padding rows (truncated Poisson):
    ``size`` then counts its examples, and ``padding.rows`` its rows.
    """

    number: int
    size: int
    units: torch.Tensor | None = None
    epoch_position: int | None = None
    unit: str = "example"
    #: Its collate probe's verdict, (status, detail) (:mod:`dpfy.data.collate_probe`; None:
    #: not probed).
    collate_probe: tuple[str, str] | None = None
    padding: Padding | None = None


class BatchRefused(ValueError):
    """A step whose batch is not the one the private sampler drew; nothing was changed."""


class Provenance:
    """The loader → engine → optimizer record of drawn and stepped batches.

    Invariant: ``stepped`` is the number of batches a private step consumed, which equals the
    number of training steps in the run's ledger (both advance together in the optimizer); a
    checkpoint stores both, so a ledger that does not belong with the sampler state is refused.
    """

    def __init__(self) -> None:
        self.current: DrawnBatch | None = None
        self.drawn = 0  # batches handed out since the run began
        self.stepped = 0  # batches consumed by a completed private step
        self._next = 0  # the number the next step's batch must carry: none may be skipped
        #: The tensors of the batch in hand as handed out, and each one's version counter then
        #: (:meth:`hold`): a step that takes tensors rather than layer calls checks against it.
        self._held: tuple[tuple[weakref.ref[torch.Tensor], int], ...] = ()

    def publish(
        self,
        size: int,
        units: torch.Tensor | None = None,
        epoch_position: int | None = None,
        unit: str = "example",
        collate_probe: tuple[str, str] | None = None,
        padding: Padding | None = None,
    ) -> DrawnBatch:
        """The loader hands out a new batch: it becomes the only one a step may use."""
        self.current = DrawnBatch(
            self.drawn, size, units, epoch_position, unit, collate_probe, padding
        )
        self.drawn += 1
        return self.current

    def hold(self, batch: Any) -> None:
        """Remember the tensors of the batch just published, as handed out (weakly)."""
        self._held = tuple((weakref.ref(t), t._version) for t in batch_tensors(batch))

    def check_handed(self, tensors: tuple[torch.Tensor, ...]) -> DrawnBatch:
        """The batch in hand, if ``tensors`` are its tensors as the loader handed them out.

        A step fed tensors directly (:class:`~dpfy.train.compiled_step.CompiledStep`) must be fed
        the very tensors of the loader's last batch — not a copy, a slice, another batch of the
        same size, or the batch after an in-place write (each tensor's version counter) — so
        that which rows it holds is what the sampler drew.
        """
        batch = self.current
        held = {id(t): version for ref, version in self._held if (t := ref()) is not None}
        if batch is not None and not held:
            raise BatchRefused(
                "the private loader's last batch holds no tensor this step could be fed (or "
                "they were all freed); pass the tensors of the batch as the loader handed it out"
            )
        for tensor in tensors:
            if id(tensor) not in held:
                raise BatchRefused(
                    "this step was given tensors that are not the private loader's last batch "
                    "(a copy, a slice, a tensor moved to another device or dtype, or a batch "
                    "made by hand), so which examples it holds is not what the sampler drew; "
                    "pass the batch exactly as `for batch in private.loader:` handed it out (the "
                    "step moves it to the model's device itself). Nothing was changed"
                )
            if tensor._version != held[id(tensor)]:
                raise BatchRefused(
                    "a tensor of the loader's batch was written in place after it was handed "
                    "out (through a torch operation), so its rows may no longer be the examples "
                    "the sampler drew; transform data in the dataset or collate_fn, not in the "
                    "loop. Nothing was changed"
                )
        if batch is None:  # a fresh Provenance holds nothing, so this is unreachable
            raise BatchRefused("no batch has been drawn by the private loader yet")
        return batch

    def reorder(self, order: torch.Tensor) -> torch.Tensor:
        """The batch in hand was permuted by ``order`` (virtual batching): permute its units."""
        batch = self.current
        if batch is None or batch.units is None:
            raise RuntimeError("no batch with clipping units is in hand to reorder")
        self.current = dataclasses.replace(batch, units=batch.units[order])
        return self.current.units

    def stamp(self) -> int | None:
        """The number a layer call captured now is stamped with (None: no batch drawn yet)."""
        return None if self.current is None else self.current.number

    def check(self, stamps: set[int | None]) -> DrawnBatch:
        """The batch this step uses, after refusing every other origin of its layer calls."""
        batch = self.current
        if batch is None or None in stamps:
            raise BatchRefused(
                "this step's batch was not drawn by the run's private loader, so its sampling "
                "is not what the ledger accounts; draw batches with `for batch in "
                "private.loader:` (one loader batch per step)"
            )
        if batch.number < self._next:
            raise BatchRefused(
                "this batch was already used for a step; each step needs a fresh batch from the "
                "private loader (a batch stepped on twice is accounted once but released twice)"
            )
        if stamps - {batch.number}:
            raise BatchRefused(
                "this step holds gradients of more than one loader batch (gradient accumulation "
                "by hand); one step is one sampled batch: to split a batch over memory, pass "
                "max_physical_batch_size to make_private, or feed one loader batch in pieces "
                "with optimizer.accumulate() after each backward pass but the last"
            )
        if batch.number > self._next:
            raise BatchRefused(
                f"{batch.number - self._next} batch(es) drawn by the private loader since the "
                "last step were skipped (never stepped on); whether a batch is used must not "
                "depend on its data (skipping one reveals what it held), so step on every batch "
                "the loader hands out, empty ones included. Nothing was changed; reload the last "
                "checkpoint to go on"
            )
        return batch

    def check_size(self, batch: DrawnBatch, examples: int) -> None:
        """The examples the engine clipped must be the drawn batch, all of it and nothing else."""
        if examples == 0 and batch.size > 0:
            raise BatchRefused(
                f"optimizer.step() was called with no backward pass over the batch of "
                f"{batch.size} examples since the last step or zero_grad(): call "
                "loss.backward() on the batch's loss before optimizer.step(). Nothing was changed"
            )
        if examples != batch.size:
            raise BatchRefused(
                f"the step clipped {examples} examples but the private loader drew a batch of "
                f"{batch.size}; pass each loader batch to the model whole and unchanged (to "
                "split a batch over memory, pass max_physical_batch_size to make_private, or "
                "feed it in pieces and call optimizer.accumulate() after each backward pass but "
                "the last)"
            )

    def consume(self, batch: DrawnBatch) -> None:
        """A private step completed on ``batch``: it can never be stepped on again."""
        self._next = batch.number + 1
        self.stepped += 1

    @property
    def pending(self) -> int:
        """Batches handed out since the last step and not stepped on (normally 0 or 1)."""
        return self.drawn - self._next

    def state_dict(self, back: int = 0) -> dict[str, Any]:
        """Counters a checkpoint binds the ledger to, ``back`` unstepped batches undrawn."""
        return {"drawn": self.drawn - back, "stepped": self.stepped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the counters; the batch in hand (if any) is forgotten, not re-used."""
        if not isinstance(state, dict) or not all(
            isinstance(state.get(key), int) for key in ("drawn", "stepped")
        ):
            raise ValueError("the loader state holds no batch counters (drawn, stepped)")
        drawn = check_count("drawn", state["drawn"])
        stepped = check_count("stepped", state["stepped"])
        if stepped > drawn:
            raise ValueError(f"{stepped} batches stepped but only {drawn} drawn")
        self.drawn, self.stepped = drawn, stepped
        self.current, self._next, self._held = None, drawn, ()
