"""DP-SGD with the Hugging Face ``Trainer``: :class:`DPTrainer` (the ``dpfy[hf]`` extra).

The Trainer keeps its loop — logging, evaluation, schedulers, bf16 autocast — while every
optimizer step is dpfy's one private step (guide alg. 1):

- **batches** come from the private loader: each step's batch is a Poisson sample of expected
  size ``B = per_device_train_batch_size × gradient_accumulation_steps``, cut into
  ``gradient_accumulation_steps`` pieces that the Trainer feeds one by one;
- **each piece** is clipped per example right after its backward pass
  (``optimizer.accumulate()``); the Trainer's ``optimizer.step()`` at the end of the
  accumulation closes the step: noise once, ÷ the expected batch size B, one ledger entry;
- the Trainer's own gradient-norm clipping (``max_grad_norm`` of ``TrainingArguments``) and its
  1/k loss scaling are switched off: the per-example clip norm C is dpfy's ``max_grad_norm``;
- the run is exactly the planned number of steps, and the privacy report card is written into
  ``<output_dir>/privacy-report`` when training ends.

LoRA adapters from ``peft`` train as any model whose other parameters are frozen: only the
trainable parameters are clipped, noised and updated. Trainer checkpoints hold no privacy
ledger: save and resume the private run with ``trainer.private.save`` / ``load``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from dpfy.data.batches import batch_length
from dpfy.train.builder import make_private
from dpfy.train.session import PrivateTraining
from dpfy.train.virtual import AccumulationPieces

__all__ = ["AccumulationPieces", "DPTrainer"]


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` whose every optimizer step is a DP-SGD step.

    ``delta``, ``max_grad_norm`` (the per-example clip norm C) and one of ``target_epsilon`` /
    ``noise_multiplier`` are the privacy settings; ``private_options`` go to
    :func:`dpfy.make_private` as they are (``seed``, ``engine``, ``accountant``, …). The expected
    batch size is ``per_device_train_batch_size × gradient_accumulation_steps`` and the run
    lasts ``num_train_epochs`` epochs. ``optimizer_cls`` (AdamW by default) is built over the
    trainable parameters with the arguments' learning rate and weight decay.
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        train_dataset: Any,
        *,
        delta: float,
        max_grad_norm: float,
        target_epsilon: float | None = None,
        noise_multiplier: float | None = None,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        private_options: dict[str, Any] | None = None,
        **trainer_options: Any,
    ) -> None:
        if "optimizers" in trainer_options:
            raise ValueError(
                "DPTrainer builds its private optimizer itself; pass optimizer_cls (and the "
                "learning rate in TrainingArguments) instead of optimizers="
            )
        if args.max_steps > 0:
            raise ValueError(
                "DPTrainer runs the planned steps of num_train_epochs epochs; leave max_steps "
                "unset and choose num_train_epochs"
            )
        if args.world_size > 1:
            raise ValueError(
                f"DPTrainer runs in one process for now, but this launch has {args.world_size} "
                "(the Trainer would wrap the model in DDP and average unclipped gradients); "
                "train across processes with dpfy.make_private and your own loop "
                "(docs/distributed.md), or launch one process"
            )
        _refuse_coupling_options(args, trainer_options, private_options or {})
        # The Trainer's own clipping of the (already private) batch gradient is not DP clipping.
        args = dataclasses.replace(args, max_grad_norm=0.0)
        super().__init__(model=model, args=args, train_dataset=train_dataset, **trainer_options)
        accumulation = args.gradient_accumulation_steps
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = optimizer_cls(trainable, lr=args.learning_rate, weight_decay=args.weight_decay)
        self.private: PrivateTraining = make_private(
            self.model,
            optimizer,
            train_dataset,
            batch_size=args.per_device_train_batch_size * accumulation,
            epochs=args.num_train_epochs,
            delta=delta,
            max_grad_norm=max_grad_norm,
            target_epsilon=target_epsilon,
            noise_multiplier=noise_multiplier,
            loader_options={"collate_fn": self.data_collator},
            **(private_options or {}),
        )
        self.optimizer = self.private.optimizer
        self.args.max_steps = self.private.plan.steps  # exactly the planned (accounted) steps

    def get_train_dataloader(self) -> Any:
        """The private loader's batches, each cut into the accumulation's pieces."""
        return AccumulationPieces(self.private.loader, self.args.gradient_accumulation_steps)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The private optimizer (built with the run)."""
        self.optimizer = self.private.optimizer
        return self.optimizer

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """Forward and backward one piece, then clip its examples into the step's sum.

        The loss is the head's mean over this piece's examples (each example's own token mean
        for sequence heads, which dpfy substitutes): no 1/k scaling, since each piece's examples
        are clipped as they are and the step divides by the expected batch size.
        """
        model.train()
        if batch_length(inputs) == 0:  # an empty piece: nothing to clip (the step still comes)
            return torch.zeros((), device=self.args.device)
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        loss.backward()
        self.private.optimizer.accumulate()
        return loss.detach() / self.args.gradient_accumulation_steps  # the Trainer logs the sum

    def train(self, resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
        """Train the planned steps privately; then write the privacy report card.

        A Trainer checkpoint holds no privacy ledger, so resuming from one is refused: resume
        the private run with ``trainer.private.load(path)`` (saved by ``trainer.private.save``).
        """
        if resume_from_checkpoint not in (None, False):
            raise ValueError(
                "a Trainer checkpoint holds no privacy ledger, so its steps would go unaccounted; "
                "save the run with trainer.private.save(path) and resume with "
                "trainer.private.load(path) before trainer.train()"
            )
        output = super().train(**kwargs)
        if self.is_world_process_zero():
            self.private.report(Path(self.args.output_dir) / "privacy-report", overwrite=True)
        return output

    def epsilon(self) -> float:
        """ε spent so far at the run's δ."""
        return self.private.epsilon()


def _refuse_coupling_options(
    args: TrainingArguments, trainer_options: dict[str, Any], private_options: dict[str, Any]
) -> None:
    """Refuse Trainer settings that would break per-example clipping or the planned steps.

    Label smoothing divides by the piece's count of real tokens (each example's gradient then
    depends on the others' lengths); a custom ``compute_loss_func`` is unseen by the loss probe;
    fp16 needs a loss scaler that skips steps on overflow (a skipped step is still spent, and
    the scaler cannot see the private step's gradient); the Trainer already cuts each batch into
    ``gradient_accumulation_steps`` pieces, so dpfy's own chunking would count steps twice.
    """
    problems = []
    if getattr(args, "label_smoothing_factor", 0.0):
        problems.append(
            "label_smoothing_factor > 0 (the Trainer's label smoother averages over every token "
            "of the piece, so each example's gradient depends on the other examples); smooth "
            "inside a per-example loss or leave it 0"
        )
    if trainer_options.get("compute_loss_func") is not None:
        problems.append(
            "compute_loss_func (a loss over the whole piece that dpfy's checks cannot see); use "
            "the model's own loss, or dpfy.make_private with private.criterion in your own loop"
        )
    if getattr(args, "fp16", False):
        problems.append(
            "fp16=True (its loss scaler skips overflowing steps, which are still spent, and "
            "cannot see the private gradient); use bf16=True"
        )
    if "max_physical_batch_size" in private_options:
        problems.append(
            "private_options max_physical_batch_size (the Trainer already cuts each batch into "
            "gradient_accumulation_steps pieces); lower per_device_train_batch_size and raise "
            "gradient_accumulation_steps instead"
        )
    if problems:
        raise ValueError("DPTrainer cannot train privately with " + "; ".join(problems))
