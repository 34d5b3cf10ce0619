"""DP-SGD with PyTorch Lightning: :func:`make_private` and its :class:`DPCallback`.

Lightning keeps its loop (logging, validation, checkpoints of its own, precision plugins) while
every optimizer step is dpfy's private step (guide alg. 1):

- the batches are the private loader's Poisson batches, each cut into
  ``accumulate_grad_batches`` pieces (:class:`~dpfy.train.virtual.AccumulationPieces`);
- after each piece's backward pass the callback clips its examples into the step's sum
  (``optimizer.accumulate()``); Lightning's ``optimizer.step()`` closes the step: noise once,
  ÷ the expected batch size, one ledger entry;
- Lightning's 1/k scaling of an accumulated loss is switched off (each piece's mean loss is
  clipped per example as it is), and the fit is refused unless it runs the planned steps, with
  the private optimizer, no gradient clipping of Lightning's own and the same accumulation.

Import it only with Lightning installed (``pip install "dpfy[lightning]"``): it imports
``lightning`` (or the older ``pytorch_lightning``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpfy.train.builder import make_private as _make_private
from dpfy.train.optim import DPOptimizer
from dpfy.train.session import PrivateTraining
from dpfy.train.virtual import AccumulationPieces

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.optimization.automatic import ClosureResult
except ImportError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from pytorch_lightning.loops.optimization.automatic import (  # type: ignore[no-redef]
        ClosureResult,
    )

__all__ = ["DPCallback", "PrivateLightning", "make_private"]


class _PieceMean(ClosureResult):
    """The training step's loss as it is: no division by ``accumulate_grad_batches``.

    Each piece's loss is the mean over its own examples; the private step clips each example's
    gradient of it and divides the noisy sum by the expected batch size, so a 1/k scaling would
    shrink every example's gradient before clipping (clipping at k·C in effect).
    """

    @classmethod
    def from_training_step_output(cls, training_step_output: Any, normalize: int = 1) -> Any:
        """Lightning's result of the step, never normalised."""
        return super().from_training_step_output(training_step_output, 1)


class DPCallback(pl.Callback):
    """Clips each piece after its backward pass and checks the fit before it starts."""

    def __init__(
        self, private: PrivateTraining, pieces: int, report_dir: str | Path | None = None
    ) -> None:
        self.private = private
        self.pieces = pieces
        self.report_dir = None if report_dir is None else Path(report_dir)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Refuse a fit whose settings would change what the ledger accounts."""
        problems = _fit_problems(trainer, self.private, self.pieces)
        if problems:
            raise ValueError(
                "this Lightning fit cannot train privately as planned: "
                + "; ".join(problems)
                + ". Build the Trainer from dpfy.lightning.make_private's result: "
                "Trainer(max_steps=run.max_steps, accumulate_grad_batches=run.pieces, "
                "callbacks=[run.callback]) and return run.optimizer from configure_optimizers"
            )
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        loop.output_result_cls = _PieceMean

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        """Clip the piece just backpropagated into the step's sum."""
        self.private.optimizer.accumulate()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Write the privacy report card (main process) when ``report_dir`` was given."""
        if self.report_dir is not None and trainer.is_global_zero:
            self.private.report(self.report_dir, overwrite=True)


def _fit_problems(trainer: Any, private: PrivateTraining, pieces: int) -> list[str]:
    """What in the Trainer's settings differs from the private run's plan."""
    problems = []
    if trainer.accumulate_grad_batches != pieces:
        problems.append(
            f"accumulate_grad_batches is {trainer.accumulate_grad_batches}, but the loader cuts "
            f"each batch into {pieces} pieces"
        )
    if trainer.max_steps != private.plan.steps:
        problems.append(
            f"max_steps is {trainer.max_steps}, but the run is planned (and accounted) for "
            f"{private.plan.steps} steps"
        )
    limit = trainer.limit_train_batches
    if isinstance(limit, int) and limit % pieces:
        problems.append(
            f"limit_train_batches is {limit}, which cuts a batch of {pieces} pieces in the middle "
            f"(a step is one whole loader batch); use a multiple of {pieces}"
        )
    if isinstance(limit, float) and limit != 1.0:
        problems.append(
            "limit_train_batches is a fraction, which may cut a batch's pieces in the middle; "
            f"give a whole number of pieces, a multiple of {pieces}"
        )
    if trainer.gradient_clip_val not in (None, 0, 0.0):
        problems.append(
            "gradient_clip_val is set: Lightning would clip the already private batch gradient; "
            "the per-example clip norm is make_private's max_grad_norm"
        )
    if trainer.world_size != private.replicas.world_size:
        problems.append(
            f"the fit runs {trainer.world_size} processes but the private run was made for "
            f"{private.replicas.world_size} (Lightning starts its process group inside fit, "
            "after make_private); train in one process, or across processes with "
            "dpfy.make_private and your own loop"
        )
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1 or _unwrapped(optimizers[0]) is not private.optimizer:
        problems.append("configure_optimizers must return run.optimizer (the private optimizer)")
    return problems


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer inside Lightning's wrapper, if any."""
    return getattr(optimizer, "_optimizer", optimizer)


@dataclasses.dataclass(frozen=True)
class PrivateLightning:
    """What a Lightning fit needs: the private optimizer, the pieces loader, the callback."""

    private: PrivateTraining
    loader: AccumulationPieces
    callback: DPCallback
    pieces: int

    @property
    def optimizer(self) -> DPOptimizer:
        """Return this from ``configure_optimizers``."""
        return self.private.optimizer

    @property
    def max_steps(self) -> int:
        """The Trainer's ``max_steps``: the run's planned steps."""
        return self.private.plan.steps


def make_private(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_dataset: Any,
    *,
    accumulate_grad_batches: int = 1,
    report_dir: str | Path | None = None,
    **private_options: Any,
) -> PrivateLightning:
    """:func:`dpfy.make_private` for a LightningModule: the run, its loader cut into pieces, and
    the callback.

    ``private_options`` are :func:`dpfy.make_private`'s (``batch_size`` is the expected batch
    size B of one step, ``epochs`` or ``steps``, ``delta``, ``max_grad_norm``, ε or σ, …);
    ``accumulate_grad_batches`` pieces make one step. ``report_dir``: where the report card is
    written when the fit ends.
    """
    if "max_physical_batch_size" in private_options:  # Lightning would count each chunk a step
        raise ValueError(
            "dpfy.lightning cuts each batch into accumulate_grad_batches pieces itself; leave "
            "max_physical_batch_size out and raise accumulate_grad_batches instead"
        )
    private = _make_private(module, optimizer, train_dataset, **private_options)
    pieces = AccumulationPieces(private.loader, accumulate_grad_batches)
    return PrivateLightning(
        private, pieces, DPCallback(private, pieces.pieces, report_dir), pieces.pieces
    )
