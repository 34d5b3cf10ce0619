"""Gradient accumulation: one sampled batch, one step, over several backward passes.

A logical batch is one batch the private sampler drew, and one private step (its noise, its
accounting, its update). It may be processed in several *physical* batches — the private
loader's chunks (``max_physical_batch_size``), or pieces a trainer cuts it into for
``gradient_accumulation_steps`` — each with its own forward and backward pass. After each
backward pass but the last, ``optimizer.accumulate()`` clips that pass's examples into the
logical batch's sum; ``optimizer.step()`` clips the last pass and closes the logical batch:
noise once, ÷ the expected batch size, one ledger entry, one update (guide alg. 1; the
accounting sees one Poisson draw, however many passes it took).

What this module refuses, before anything changes:

- a batch split over two backward passes with no ``accumulate()`` between them is named as such
  (a forward pass that started over an earlier pass's unclipped gradients explains the layers'
  repeated calls);
- pieces of two *different* loader batches summed into one step (two sampled batches are two
  draws; accounting them as one is not the event the ledger records);
- a batch whose clipping units are microbatches or users, or a padded (truncated-Poisson) batch,
  cut by hand (a unit must stay whole in one pass, and padding rows are marked for the whole
  batch: the private loader's ``max_physical_batch_size`` cuts between units and carries the
  marks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpfy.data.provenance import BatchRefused, DrawnBatch
from dpfy.train.grads import GradEngine

__all__ = ["Accumulation"]

_FIX = (
    "call private.optimizer.accumulate() after each backward pass but the last of a loader "
    "batch, and optimizer.step() after the last"
)


class Accumulation:
    """The physical batches of the logical batch in progress, watched from the model's forward.

    A forward pre-hook on the model counts forward passes that start while captured layer calls
    already hold their gradients (an earlier pass was backpropagated and not clipped yet).
    """

    def __init__(self, engine: GradEngine) -> None:
        self.engine = engine
        self.unclipped = 0  # forward passes begun over an earlier pass's unclipped gradients
        self.open: int | None = None  # the loader batch whose sum is open (accumulated into)
        self._handle = engine.model.register_forward_pre_hook(self._before)

    def _before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A forward pass begins: were the last pass's gradients left unclipped?"""
        # not the engine's own replays while it clips (a root that owns parameters is re-run)
        if torch.is_grad_enabled() and self.engine.capturing and self.engine.batch_stamps():
            self.unclipped += 1

    def refuse(self, current: DrawnBatch | None, *, split: bool, chunked: bool) -> None:
        """Raise :class:`BatchRefused` when this physical batch cannot join the open sum.

        ``current`` is the loader batch in hand; ``split`` whether this logical batch is (or is
        being) processed in several passes; ``chunked`` whether the private loader cut it.
        """
        if self.open is not None and current is not None and current.number != self.open:
            raise BatchRefused(
                "this step would sum pieces of two loader batches (gradient accumulation over "
                "batches): one step is one batch the sampler drew, so its sampling is what the "
                "ledger accounts. Split each loader batch instead — "
                f"{_FIX}, or pass max_physical_batch_size to make_private. Nothing was changed; "
                "reload the last checkpoint to go on"
            )
        if split and not chunked and current is not None and current.padding is not None:
            raise BatchRefused(
                "this loader batch is padded to a static shape (truncated Poisson), and which "
                "of its rows are padding is known for the whole batch only, so it cannot be cut "
                "by hand; pass max_physical_batch_size to make_private (its chunks carry their "
                "padding rows). Nothing was changed"
            )
        if split and not chunked and current is not None and current.units is not None:
            raise BatchRefused(
                f"this loader batch is clipped per {current.unit}, and a {current.unit}'s "
                "examples must be clipped together in one pass, so it cannot be cut by hand; "
                "pass max_physical_batch_size to make_private (its chunks are cut between "
                f"{current.unit}s). Nothing was changed"
            )

    def explain(self, err: Exception) -> Exception:
        """The refusal to raise for ``err``, met while clipping or sizing this step's batch.

        When forward passes began over an earlier pass's unclipped gradients, the layers saw
        several calls (the fast engine's "called 2 times") or too few examples per call: the
        cause is the missing ``accumulate()``, and that is what is said.
        """
        if not self.unclipped:
            return err
        passes = self.unclipped + 1
        return BatchRefused(
            f"this step's gradients come from {passes} forward and backward passes with no "
            "optimizer.accumulate() between them, so the layers saw several calls whose "
            "examples cannot be told apart. To split one loader batch over several backward "
            f"passes (gradient accumulation), {_FIX}. Nothing was changed ({err})"
        )

    def clipped(self, batch: DrawnBatch) -> None:
        """A physical batch of ``batch`` was clipped into the open sum."""
        self.open = batch.number
        self.unclipped = 0

    def close(self) -> None:
        """The logical batch ended (stepped on, or abandoned): no sum is open."""
        self.open = None
        self.unclipped = 0

    def remove(self) -> None:
        """Remove the forward hook (the run was detached)."""
        self._handle.remove()
