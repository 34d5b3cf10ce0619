"""DPOptimizer: the one private step — guard, clip, noise, ÷ expected units, update, record.

Every variant takes this step (guide alg. 1): DP-SGD, microbatches, user-level DP-SGD, DP-FTRL,
BandMF and BLT differ only in their plan (:class:`~dpfy.plan.privacy_plan.PrivacyPlan`: the
clipping unit, the sampling) and in the noise mechanism (:mod:`dpfy.train.noise.mechanisms`),
which also states a step's event when its sampling record cannot (correlated noise).

The wrapped optimizer only post-processes privatised gradients (guide §4.2, §5.5.2), so SGD,
Adam, AdamW, Adagrad… all keep the same guarantee. The rules this module enforces:

- noise ``N(0, σ²C²)`` per coordinate on the *sum* of clipped per-example gradients, then division
  by the **expected** batch size — the realised size is never used;
- every trainable parameter gets noise every step, zero-gradient and sparse ones included; frozen
  parameters are never touched;
- an empty batch is still a step: noise only, accounted;
- microbatch clipping of averages (guide alg. 3) has sensitivity 2C, so the noise std is 2σC and
  the sum is divided by the expected number of microbatches;
- the ledger's budget guard runs before anything changes;
- a step's batch is the one the private loader drew last, whole, used once
  (:mod:`dpfy.data.provenance`), and every parameter the wrapped optimizer would update is one
  the engine clipped and noised: anything else is refused before anything changes;
- each example's contribution depends on that example alone, and nothing changed the model
  since the last step (:mod:`dpfy.train.behaviour`): a probe that saw otherwise refuses the
  step before anything changes.

The clip → sum ÷ expected units → noise part is the private aggregation DP-FedAvg and the Flower
strategy release through too (:class:`~dpfy.train.private_aggregation.PrivateAggregation`).
Independent noise is drawn in one place, on the training thread (on the parameters' device): on
the last physical batch of a step the engine opens each parameter's sum from its noise just
before that layer is summed, and adds the clipped sum into it in place, so a step holds one
parameter-sized buffer per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dpfy.data.provenance import BatchRefused, DrawnBatch, Provenance
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingRecord
from dpfy.train.accumulation import Accumulation
from dpfy.train.behaviour.checks import BehaviourChecks
from dpfy.train.distributed import GradientAggregator, LocalAggregator
from dpfy.train.grads import ClipResult, GradEngine, NoiseStart
from dpfy.train.grads.hooks import refuse_gradient_hooks
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.noise.mechanisms import NoiseMechanism
from dpfy.train.noise.source import NoiseSource, TorchNoise
from dpfy.train.opacus_names import OPTIMIZER_ATTRIBUTES, attribute_error
from dpfy.train.private_aggregation import PrivateAggregation
from dpfy.train.step_record import StepRecord


class NonFiniteGradientError(ValueError):
    """A per-example gradient was NaN or infinite; the step was not applied."""


class BatchBoundary:
    """Which physical chunk of the logical batch is being processed (virtual batching).

    The virtual-batch loader sets it before yielding each chunk: ``chunk`` is its [start, stop)
    in the logical batch (None: the whole batch) and ``closes_batch`` whether it is the last.
    The optimizer reads it in ``step()`` and only noises and updates at the end.
    """

    def __init__(self) -> None:
        self.closes_batch = True
        self.chunk: tuple[int, int] | None = None


class DPOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer; ``step()`` privatises the gradient before the wrapped update.

    It subclasses ``torch.optim.Optimizer`` (sharing the wrapped optimizer's ``param_groups``
    and ``state``) so learning-rate schedulers and other tools accept it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        engine: GradEngine,
        ledger: PrivacyLedger,
        sampling: SamplingRecord,
        plan: PrivacyPlan,
        *,
        provenance: Provenance,
        noise: NoiseSource | None = None,
        boundary: BatchBoundary | None = None,
        aggregator: GradientAggregator | None = None,
        behaviour: BehaviourChecks | None = None,
    ) -> None:
        if not isinstance(provenance, Provenance):
            raise ValueError(
                "provenance must be the private loader's record of its batches "
                "(DPDataLoader.provenance): a step must know its batch came from the sampler"
            )
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("the optimizer is already private; pass the plain torch optimizer")
        if not isinstance(plan, PrivacyPlan):
            raise ValueError("plan must be the run's PrivacyPlan (dpfy.plan.variants.make_plan)")
        if plan.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {plan.loss_reduction!r}")
        _check_ledger_fits(ledger, plan)
        if sampling != plan.sampling_record():
            raise ValueError(
                f"the sampler reports {sampling} but the plan was made for "
                f"{plan.sampling_record()}: build the loader from the same plan"
            )
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.original_optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.engine = engine
        self.ledger = ledger
        self.sampling = sampling
        self.plan = plan
        self.boundary = boundary if boundary is not None else BatchBoundary()
        self.aggregator = aggregator if aggregator is not None else LocalAggregator()
        #: clip → sum ÷ expected units → the plan's noise (sums formed at 1/B, noise at σC/B
        #: times this rank's share: no pass over the parameters divides afterwards).
        self.aggregation = PrivateAggregation.from_plan(
            plan,
            engine.params,
            noise if noise is not None else TorchNoise(),
            self.aggregator.share_std,
        )
        self.clip_observers: list[Callable[[ClipResult], None]] = []
        self.provenance = provenance
        engine.follow(provenance.stamp)
        self._private = {id(p) for p in engine.params.values()}
        #: What the user's code does, observed (make_private always builds it): None only for
        #: an optimizer assembled by hand, which then probes nothing.
        self.behaviour = behaviour
        #: The physical batches (backward passes) of the logical batch in progress.
        self.accumulation = Accumulation(engine)

    def __getattr__(self, name: str) -> Any:
        """Only reached for a missing attribute: Opacus's names get dpfy's spelling."""
        raise attribute_error(type(self).__name__, name, OPTIMIZER_ATTRIBUTES)

    @property
    def mechanism(self) -> NoiseMechanism:
        """The plan's noise mechanism (its state is what a checkpoint carries)."""
        return self.aggregation.mechanism

    @property
    def noise(self) -> NoiseSource:
        """The source the mechanism draws from (replaceable: the mechanism keeps its state)."""
        return self.mechanism.source

    @noise.setter
    def noise(self, source: NoiseSource) -> None:
        self.mechanism.source = source

    @property
    def clipping_unit(self) -> str:
        """The unit this optimizer clips and accounts: 'example', 'microbatch' or 'user'."""
        return self.plan.clipping_unit

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Clip this batch; at the end of a logical batch, noise, account, and update.

        Returns the closure's loss (if a closure was given) like any torch optimizer.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._process(closes=self.boundary.closes_batch)
        return loss

    def accumulate(self) -> None:
        """Clip the physical batch just backpropagated into this step's sum; no update yet.

        Gradient accumulation: to process one loader batch in several forward and backward
        passes (pieces that fit in memory, or a trainer's ``gradient_accumulation_steps``),
        call this after each backward pass but the last, and :meth:`step` after the last. Each
        piece is clipped per example as it comes; the step then noises once, divides by the
        expected batch size, accounts one step and updates (:mod:`dpfy.train.accumulation`).
        """
        self._process(closes=False, split=True)

    def _process(self, *, closes: bool, split: bool = False) -> None:
        """Clip what the last backward pass captured; when ``closes``, noise, account, update."""
        batch = self._take_batch(closes, split)
        opening = self.aggregation.opening() if closes else None
        result = self._guarded(self._explained, self._clip, batch, opening, self.aggregation.scale)
        for observe in self.clip_observers:  # diagnostics only: never fed back into training
            observe(result)
        if not bool(torch.isfinite(result.norms).all()):
            self.abandon()
            raise NonFiniteGradientError(
                "a per-example gradient is NaN or infinite (a non-finite loss?); the step was not "
                "applied and the model and ledger are unchanged — check the inputs and the loss, "
                "or lower the learning rate, then reload the last checkpoint. Do not catch this "
                "and train on: skipping a batch because of one example is not accounted"
            )
        self.accumulation.clipped(batch)
        if closes:
            self.commit(batch, self.engine.num_examples, self._write_private_grads)

    def commit(self, batch: DrawnBatch, examples: int, write_grads: Callable[[], None]) -> None:
        """Account ``batch``'s step, write the private gradients, update, record — in that order.

        Every path that releases a step ends here (the hooked step, and the compiled step of
        :mod:`dpfy.train.compiled_step`, which clips outside the engine): the step's event, the
        check that ``examples`` is the drawn batch, and the budget guard run before
        ``write_grads`` sets any ``.grad``; once it has, the step is recorded whatever the
        update does.
        """
        sampling = self._guarded(self.mechanism.sampling, self.sampling, batch)
        sampling = self._guarded(sampling.at_epoch_position, batch.epoch_position)
        sigma = self.plan.noise_multiplier
        charged = self._guarded(self.mechanism.step_event, sampling, batch, sigma)
        record = StepRecord(sampling, sigma, batch_size=examples, charged=charged)
        self._guarded(self._explained, self.provenance.check_size, batch, examples)
        self._guarded(self.ledger.check_step, record)  # BudgetExhausted before anything changes
        write_grads()
        try:  # the privatised gradient now exists: it is accounted whatever the update does
            self.original_optimizer.step()
        finally:
            self.ledger.record(record)
            self.provenance.consume(batch)
            self.engine.reset()
            self.accumulation.close()
            if self.behaviour is not None:
                self.behaviour.accept_state()

    def _take_batch(self, closes: bool = True, split: bool = False) -> DrawnBatch:
        """The drawn batch this step uses, after refusing every other path into the update.

        Refused, with nothing changed: layer calls from anything but the batch the private
        loader drew last (or from a batch already stepped on, or after one was skipped), a
        batch whose clipping units are not this optimizer's, and a parameter the wrapped
        optimizer would update that the engine does not clip and noise (unfrozen, or added with
        ``add_param_group``, after make_private), and a split batch that cannot be summed
        (:class:`~dpfy.train.accumulation.Accumulation`).
        """
        return self._guarded(self._checked_batch, closes, split)

    def _checked_batch(self, closes: bool, split: bool) -> DrawnBatch:
        """:meth:`_take_batch` without the clean-up on refusal."""
        self._check_updated_params()
        self.accumulation.refuse(
            self.provenance.current,
            split=split or self.accumulation.open is not None,
            chunked=self.boundary.chunk is not None,
        )
        batch = self.provenance.check(self.engine.batch_stamps())
        self._check_batch_fits(batch, closes)
        return batch

    def take_handed(self, tensors: tuple[torch.Tensor, ...]) -> DrawnBatch:
        """The batch a step fed its tensors directly uses, after a hooked step's refusals.

        For :class:`~dpfy.train.compiled_step.CompiledStep`, which computes per-example
        gradients outside the engine: ``tensors`` must be the loader's last batch as handed out
        (:meth:`~dpfy.data.provenance.Provenance.check_handed`), no backward pass may have
        captured gradients since the last step (two paths would feed one step), and the rest is
        :meth:`_take_batch`'s: parameters, skipped or reused batches, units, the mechanism's and
        the behaviour checks' refusals.
        """
        return self._guarded(self._checked_handed, tensors)

    def _checked_handed(self, tensors: tuple[torch.Tensor, ...]) -> DrawnBatch:
        """:meth:`take_handed` without the clean-up on refusal."""
        if self.engine.batch_stamps() or self.accumulation.open is not None:
            raise BatchRefused(
                "a backward pass captured gradients (or accumulate() opened a sum) since the last "
                "step, and this compiled step computes its own: one step may not take both. Call "
                "optimizer.zero_grad() to drop them, and train with one kind of step. Nothing was "
                "changed"
            )
        self._check_updated_params()
        refuse_gradient_hooks(self.engine.params)  # a hook's change would be lost
        handed = self.provenance.check_handed(tensors)
        batch = self.provenance.check({handed.number})
        self._check_batch_fits(batch, closes=True)
        return batch

    def _check_batch_fits(self, batch: DrawnBatch, closes: bool) -> None:
        """Refuse a batch whose units, mechanism position or behaviour do not fit this step."""
        if batch.unit != self.clipping_unit:
            raise BatchRefused(
                f"the loader's batches are clipped per {batch.unit} but this optimizer accounts "
                f"clipping per {self.clipping_unit}; build the loader and optimizer together "
                "with make_private"
            )
        self.mechanism.check(batch)
        if self.behaviour is not None:  # a coupled batch or a model changed outside the step
            self.behaviour.refuse(batch, closing=closes)

    def _check_updated_params(self) -> None:
        """Every parameter the wrapped optimizer would update must be one the engine privatises."""
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) in self._private:
                    continue
                if param.requires_grad:
                    raise BatchRefused(
                        f"a parameter of shape {tuple(param.shape)} in the optimizer is "
                        "trainable but was frozen (or absent) when the run was made private, so "
                        "its gradient would be applied unclipped and un-noised. Make every layer "
                        "you will train trainable before make_private; to unfreeze gradually, "
                        "keep the layers not yet unfrozen at lr=0 in a parameter group of their "
                        "own and raise it later"
                    )
                if param.grad is not None:
                    raise BatchRefused(
                        f"a frozen parameter of shape {tuple(param.shape)} holds a .grad (from "
                        "before make_private?) that the optimizer would apply un-noised; call "
                        "optimizer.zero_grad() before the first step"
                    )

    def _guarded(self, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one stage of the step; on any failure drop the batch in progress and re-raise."""
        try:
            return check(*args, **kwargs)
        except Exception:
            self.abandon()
            raise

    def _explained(self, stage: Callable[..., Any], *args: Any) -> Any:
        """Run ``stage``; a failure caused by a missing ``accumulate()`` is named as that."""
        try:
            return stage(*args)
        except Exception as err:
            explained = self.accumulation.explain(err)
            if explained is err:
                raise
            raise explained from err

    def abandon(self) -> None:
        """Forget the logical batch in progress (its sum and captures); the model is untouched."""
        self.engine.reset()
        self.engine.discard_captures()
        self.accumulation.close()
        self.aggregator.skip()

    def _units(self, batch: DrawnBatch) -> torch.Tensor | None:
        """The clipping unit of each example of the physical chunk being processed.

        None when nothing was captured since the last clip (a step after ``accumulate()``).
        """
        if batch.units is None or not self.engine.batch_stamps():
            return None
        start, stop = self.boundary.chunk or (0, batch.size)
        return batch.units[start:stop]

    def _clip(
        self, batch: DrawnBatch, noise: NoiseStart | None = None, scale: float = 1.0
    ) -> ClipResult:
        """Clip this physical batch's units into the engine's sum (examples, microbatches, users).

        ``noise``: on the last physical batch, the parameters whose noise is filled in now.
        ``scale`` multiplies each clipped unit before it is summed (``step`` passes 1/B).
        """
        padding = batch.padding
        if padding is not None and self.boundary.chunk is not None:
            padding = padding.chunk(*self.boundary.chunk)
        if not self.engine.batch_stamps():  # this piece was clipped already (accumulate())
            padding = None
        return self.engine.clip_and_accumulate(
            self.plan.max_grad_norm,
            self.plan.loss_reduction,  # type: ignore[arg-type]
            groups=self._units(batch),
            noise=noise,
            scale=scale,
            padding=padding,  # a static-shape batch's padding rows weigh exactly 0
        )

    def _write_private_grads(self) -> None:
        """p.grad = (clipped sum + the mechanism's noise) / expected units, for every parameter.

        Sums and noise are formed at 1/B scale; across ranks the aggregator sums the ranks'
        noised shares (dpfy.train.distributed).
        """
        summed = self.engine.summed_grads()
        noisy = self.aggregator.combine(self.aggregation.release(summed))
        for name, total in noisy.items():
            self.engine.params[name].grad = total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients and what the layers captured since the last clip.

        ``zero_grad`` means "forget the gradients computed so far": a stray backward pass
        (a validation loss) followed by it leaves nothing the next step could mix in. Captures
        no backward pass has reached yet are kept: loops such as Lightning's run the forward
        pass, then ``zero_grad``, then the backward pass of the same batch.
        """
        if self.engine.batch_stamps():  # a backward pass reached them: its gradients go
            self.engine.discard_captures()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (ledger, noise and mechanism are saved by the session)."""
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped optimizer's state (the session loads the model first).

        The model's parameters and buffers as loaded become those the next step starts from.
        """
        self.original_optimizer.load_state_dict(state_dict)
        if self.behaviour is not None:
            self.behaviour.accept_state()
        self.param_groups = self.original_optimizer.param_groups
        self.state = self.original_optimizer.state

    def __repr__(self) -> str:
        """Which optimizer is wrapped and the privacy settings."""
        s = self.plan
        return (
            f"DPOptimizer({type(self.original_optimizer).__name__}, σ={s.noise_multiplier:.4g}, "
            f"C={s.max_grad_norm:.4g}, B={s.expected_batch_size:g}, noise={s.mechanism}, "
            f"engine={self.engine.kind})"
        )


def _check_ledger_fits(ledger: PrivacyLedger, plan: PrivacyPlan) -> None:
    """The ledger must account the plan's claim: its relation, δ, accountant and budget.

    ε under another relation or δ is another claim, and a ledger without the plan's target
    would switch the budget guard off.
    """
    mine = (ledger.relation.value, ledger.delta, ledger.accountant, ledger.target_epsilon)
    planned = (plan.relation, plan.delta, plan.accountant, plan.target_epsilon)
    if mine != planned:
        raise ValueError(
            f"the ledger accounts (relation, δ, accountant, target ε) = {mine} but the plan "
            f"was made for {planned}: PrivacyLedger(delta, accountant=..., target_epsilon=..., "
            "relation=...) with the plan's values"
        )
