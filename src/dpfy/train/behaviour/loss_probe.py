"""The loss, probed: is the gradient the batched loss gives each example its gradient alone?

The engine clips what the batched backward attributes to each example; with ``mean`` reduction
it undoes the 1/n. A loss normalised over the batch — class weights under ``mean`` (divided by
the batch's total weight), a token mean over the whole batch with padding, ``ignore_index``
under ``mean``, an in-batch contrastive loss, mixup of labels, smoothing towards the batch's
label mix — attributes to each example something that depends on the others. On scheduled
batches :class:`CheckedCriterion` recomputes the loss on the detached outputs and compares, for
a few examples, the batched loss's gradient with respect to their outputs (times n for a mean)
with the gradient of the same criterion on that example alone (examples only: a static-shape
batch's padding rows are never the ones compared).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.coupling import CheckTally
from dpfy.data.row_compare import first_difference, leaves, map_rows, take_rows
from dpfy.train.behaviour.example_rows import UNKNOWN_PADDING, ExampleCount, all_rows


class CheckedCriterion:
    """The user's criterion, unchanged in what it returns, probed on scheduled batches.

    Call it like the criterion: ``criterion(output, target, ...)``. The first argument is what
    the model produced (a tensor or a container of tensors, batch-first); the others are data.
    """

    def __init__(
        self,
        criterion: Callable[..., torch.Tensor],
        schedule: CheckSchedule,
        batch_number: Callable[[], int | None],
        report: Callable[[int, str], None],
        loss_reduction: str,
        examples: ExampleCount = all_rows,
    ) -> None:
        if not callable(criterion):
            raise ValueError(
                f"criterion must be callable as criterion(output, target), got "
                f"{type(criterion).__name__}"
            )
        self.criterion = criterion
        self.schedule = schedule
        self.batch_number = batch_number
        self.report = report
        self.loss_reduction = loss_reduction
        self.examples = examples  # rows of the batch → its leading example rows (then padding)
        self.tally = CheckTally("loss")
        self.last_batch: int | None = None  # the batch it was last called on
        if schedule.off:
            self.tally.skip("the independence checks were turned off")

    def __call__(self, output: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The criterion's loss; on a scheduled batch, probe it first (nothing is changed)."""
        number = self.batch_number()
        if torch.is_grad_enabled():
            self.last_batch = number
        if number is not None and torch.is_grad_enabled() and self.schedule.due(number):
            problem = self._probe(output, args, kwargs)
            if problem is not None:
                self.tally.found(problem, "the loss")
                self.report(number, problem)
        return self.criterion(output, *args, **kwargs)

    def _probe(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The coupling the criterion shows on this batch, or None (tallied)."""
        size = next(
            (int(t.shape[0]) for _, t in leaves(output) if isinstance(t, torch.Tensor) and t.dim()),
            None,
        )
        real = None if size is None else self.examples(size)
        if size is not None and real is None:
            self.tally.skip(UNKNOWN_PADDING)
            return None
        if size is None or real is None or real < 2:
            self.tally.skip("batches of fewer than two examples have nothing to couple")
            return None
        with torch.random.fork_rng(devices=[]):
            batched = self._output_grads(output, args, kwargs, size)
            if batched is None:
                self.tally.skip(
                    "the criterion does not return one number (reduce it with mean or sum)"
                )
                return None
            scale = float(size) if self.loss_reduction == "mean" else 1.0
            for row in sorted({real - 1, real // 2}):  # examples: padding rows follow them
                picked = torch.tensor([row])
                mine = [g.index_select(0, picked) * scale for g in batched]
                alone = self._output_grads(
                    take_rows(output, size, picked),
                    take_rows(args, size, picked),
                    take_rows(kwargs, size, picked),
                    1,
                )
                problem = None if alone is None else first_difference(mine, alone)
                if problem is not None:
                    return self._reduction_mismatch(mine, alone, size) or self._message(
                        row, problem
                    )
        self.tally.passed()
        return None

    def _output_grads(
        self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], size: int
    ) -> list[torch.Tensor] | None:
        """d loss / d output for every floating output tensor of ``size`` rows (None: no scalar)."""
        tensors: list[torch.Tensor] = []

        def fresh(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            leaf = t.detach().requires_grad_(True)
            tensors.append(leaf)
            return leaf

        detached = map_rows(output, size, fresh)
        with torch.enable_grad():
            loss = self.criterion(detached, *args, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not tensors:
            return None
        grads = torch.autograd.grad(loss.sum(), tensors, allow_unused=True)
        return [
            torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True)
        ]

    def _reduction_mismatch(
        self, mine: list[torch.Tensor], alone: list[torch.Tensor] | None, size: int
    ) -> str | None:
        """The refusal when the criterion is per-example but reduced the other way than
        make_private was told (a mean where loss_reduction='sum', or the reverse)."""
        other, said = (1 / size, "sums") if self.loss_reduction == "mean" else (size, "averages")
        if alone is None or first_difference([g * other for g in mine], alone) is not None:
            return None
        return (
            f"the loss: the criterion {said} over the batch, but make_private was given "
            f"loss_reduction={self.loss_reduction!r}, so each example's gradient is scaled by "
            f"{other:g} before clipping. Fix: pass loss_reduction="
            f"{'sum' if said == 'sums' else 'mean'!r} to make_private (or reduce the criterion "
            "the other way)"
        )

    def _message(self, row: int, problem: str) -> str:
        """The refusal: what the loss did and how to make it per-example."""
        undo = "times the batch size (mean reduction)" if self.loss_reduction == "mean" else ""
        return (
            f"the loss: the gradient the batched loss gives example {row} {undo} is not its "
            f"gradient alone ({problem}), so each example's clipped gradient depends on the "
            "others (a loss normalised over the batch: class weights or ignore_index under mean "
            "reduction, a token mean over the whole batch, an in-batch contrastive loss, labels "
            "mixed across rows). Fix: a per-example loss — reduction='sum' with "
            "loss_reduction='sum', dpfy.train.sequence_loss.per_example_token_mean for token "
            "losses, weights that do not normalise over the batch"
        ).replace("  ", " ")
