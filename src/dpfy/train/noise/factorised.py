"""What BandMF and BLT share: streamed C⁻¹z noise, and its cost stated by the mechanism.

A matrix-factorisation mechanism (docs/correlated-noise.md) releases C x + σ z over the run;
step t adds w_t = (C⁻¹ z)_t to its clipped sum. Here every step draws a fresh z_t from the run's
:class:`~dpfy.train.noise.source.NoiseSource`, at the divisor's scale like DP-SGD's noise (std
σ · sensitivity / B per coordinate), and forms w_t from z_t and the buffers of past noise that
each strategy keeps (:mod:`dpfy.train.noise.banded`: the last b − 1 outputs; :mod:`.blt`: d
running sums). The buffers are the mechanism's state and travel in checkpoints, so a resumed run
continues the same correlated stream exactly once; z itself is never saved, and a resumed run
draws it from a fresh stream: noise is never replayed. Every trainable parameter gets w_t every
step, whatever its gradient.

The sampling record of these batches carries no event of its own: the mechanism charges each
step its share of the run's event (:mod:`dpfy.plan.correlated_events`: a Gaussian increment per
epoch for batches in one repeated order, a Poisson-sampled round per cycle of groups for
amplified BandMF), and refuses a batch out of the order those charges assume, or a step beyond
the plan.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from dpfy._validate import check_count, check_positive
from dpfy.data.provenance import BatchRefused, DrawnBatch
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.correlated_events import Charges, decode_strategy
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.noise.source import NoiseSource

__all__ = ["FactorisedMechanism"]


class FactorisedMechanism(abc.ABC):
    """A streaming C⁻¹z over named parameters, charged by epoch (subclasses keep the buffers).

    ``std`` is the per-coordinate std of z at the divisor's scale; ``strategy`` the plan's tuple
    (checked against a checkpoint's); ``charges`` what each step costs; ``kind`` the sampling
    the charges are for (the plan's sampler).
    """

    #: The plan's name of this mechanism, and how messages name it.
    kind: ClassVar[str]
    label: ClassVar[str]

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        source: NoiseSource,
        std: float,
        *,
        strategy: tuple[float, ...],
        charges: Charges,
        kind: SamplingKind = SamplingKind.FIXED_ORDER_EPOCHS,
    ) -> None:
        self.source = source
        self.std = check_positive("std", std)
        self.strategy = tuple(strategy)
        self.charges = charges
        self.steps = charges.steps
        self.period = charges.period  # steps between an example's chances to take part
        self.batches = SamplingKind.parse(kind)
        self.steps_done = 0
        self._like = {name: torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
                      for name, p in params.items()}  # fmt: skip
        self._start(decode_strategy(self.kind, self.strategy))

    @classmethod
    def from_plan(
        cls, plan: PrivacyPlan, params: Mapping[str, torch.Tensor], source: NoiseSource, std: float
    ) -> FactorisedMechanism:
        """The mechanism with the plan's strategy, charged for its steps, epochs and sampling
        (the factory :func:`~dpfy.train.noise.mechanisms.register_mechanism` registers)."""
        assert plan.strategy is not None  # the plan refuses a factorised plan without one
        charges = plan.charges()
        kind = SamplingKind.parse(plan.sampler)
        return cls(params, source, std, strategy=plan.strategy, charges=charges, kind=kind)

    @abc.abstractmethod
    def _start(self, strategy: Any) -> None:
        """Set up the empty buffers the decoded ``strategy`` needs."""

    # -- before the step -------------------------------------------------------------------------
    def check(self, batch: DrawnBatch) -> None:
        """The batch must be the next of the order (the epoch's, or the cycle of groups), and
        the plan must hold this step.

        A skipped batch (a refused or failed step) would shift the stream against the data
        order, and a step beyond the plan would take part in rows of C the accounting never saw:
        either could put an example in steps closer together than the accounting assumes.
        """
        if self.steps_done >= self.steps:
            raise BatchRefused(
                f"{self.label}'s strategy and its accounting cover the plan's {self.steps} "
                "steps, all taken: plan more epochs or steps to train longer"
            )
        expected = self.steps_done % self.period
        if batch.epoch_position != expected:
            raise BatchRefused(
                f"{self.label}'s noise stream is at batch {expected} of the "
                f"{'cycle' if self.batches is SamplingKind.CYCLIC_POISSON else 'epoch'} but the "
                f"loader handed out batch {batch.epoch_position}: a batch was skipped (a refused "
                "or failed step), so an example could take part in steps closer together than "
                "its accounting assumes; reload the last checkpoint (PrivateTraining.load) and "
                "step on every batch in order"
            )

    def opening(self) -> None:
        """The noise is correlated across steps: it is added once the sums are complete."""
        return None

    def sampling(self, record: SamplingRecord, batch: DrawnBatch) -> SamplingRecord:
        """The record as the sampler made it: it describes how the batches were taken only."""
        if record.kind is not self.batches:
            raise BatchRefused(
                f"{self.label} was planned for {self.batches.value!r} batches, got "
                f"{record.kind.value!r}"
            )
        return record

    def step_event(
        self, record: SamplingRecord, batch: DrawnBatch, noise_multiplier: float
    ) -> DpEvent:
        """This step's share of the run's event (:mod:`dpfy.plan.correlated_events`)."""
        return self.charges.step_event(self.steps_done, noise_multiplier)

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def privatise(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """g_t + (C⁻¹ z)_t on every parameter, from a fresh z_t and the buffers (in place)."""
        for name in self._like:
            total = sums[name]
            fresh = self.source.normal(total, self.std)
            total.add_(self._correlate(name, fresh))
        self.steps_done += 1
        return sums

    @abc.abstractmethod
    def _correlate(self, name: str, fresh: torch.Tensor) -> torch.Tensor:
        """w_t for one parameter from its fresh z_t; advances that parameter's buffers."""

    # -- checkpoints ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        """Each parameter's buffers of past noise, as a list of tensors."""

    @abc.abstractmethod
    def _restore(self, buffers: dict[str, list[torch.Tensor]]) -> None:
        """Install checked buffers (already on the parameters' devices)."""

    def state_dict(self) -> dict[str, Any]:
        """The buffers of past noise, the steps taken and the strategy: never z itself."""
        return {
            "mechanism": self.kind,
            "steps_done": self.steps_done,
            "strategy": list(self.strategy),
            "buffers": {name: [t.clone() for t in ts] for name, ts in self._buffers().items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; another mechanism, strategy or model is refused."""
        saved = state.get("mechanism") if isinstance(state, Mapping) else None
        if saved != self.kind:
            raise ValueError(
                f"the checkpoint's noise state is for the {saved!r} mechanism, this run uses "
                f"{self.kind!r}"
            )
        if tuple(float(v) for v in state.get("strategy", ())) != self.strategy:
            raise ValueError(
                f"the checkpoint's {self.label} strategy differs from this run's; resume with the "
                "same plan"
            )
        steps_done = check_count("steps_done", state["steps_done"])
        if steps_done > self.steps:
            raise ValueError(f"the state has taken {steps_done} steps of a {self.steps}-step plan")
        buffers = dict(state["buffers"])
        if set(buffers) != set(self._like):
            raise ValueError(f"the {self.label} state is for other parameters than this model's")
        placed = {}
        for name, tensors in buffers.items():
            like = self._like[name]
            if any(t.shape != like.shape for t in tensors):
                raise ValueError(
                    f"the {self.label} state is for other parameters than this model's"
                )
            placed[name] = [t.to(device=like.device, dtype=like.dtype, copy=True) for t in tensors]
        self._check_counts(placed, steps_done)
        self._restore(placed)
        self.steps_done = steps_done

    @abc.abstractmethod
    def _check_counts(self, buffers: dict[str, list[torch.Tensor]], steps_done: int) -> None:
        """Refuse buffers whose number does not fit the strategy after ``steps_done`` steps."""
