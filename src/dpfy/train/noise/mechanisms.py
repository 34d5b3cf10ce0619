"""The noise stage of the private step: how each step's clipped sum becomes a privatised gradient.

The step (:class:`~dpfy.train.optim.DPOptimizer`) is the same for every variant: budget guard →
clipped sum over clipping units → noise mechanism → ÷ expected divisor → the user's optimizer →
ledger. Only this stage differs between independent noise (DP-SGD, guide alg. 1) and noise that
is correlated across steps (DP-FTRL's tree aggregation; the matrix-factorisation mechanisms
BandMF and BLT, :mod:`dpfy.train.noise.banded` and :mod:`dpfy.train.noise.blt`: a state of past
noise, and a noisy gradient per step that is the clipped sum plus that step's share of
correlated noise). A mechanism registers under the plan's ``mechanism`` name.

A mechanism also says what each step costs when the sampling record cannot
(:meth:`NoiseMechanism.step_event`): correlated noise is accounted by its participation schema,
and a sampler only describes how the batches were taken (samplers describe sampling only).

Every mechanism works at the divisor's scale: the sums it receives are already ÷ B and ``std``
is the per-coordinate std of its noise on such a sum (σ · sensitivity / B, per rank's share).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dpfy.data.provenance import BatchRefused, DrawnBatch
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import TREE_KINDS, SamplingRecord, tree_step_event
from dpfy.plan.tree_events import new_tree_nodes
from dpfy.train.grads import NoiseStart
from dpfy.train.noise.source import NoiseSource, fill_with_noise
from dpfy.train.noise.tree import TreeNoise

__all__ = [
    "MECHANISMS",
    "GaussianMechanism",
    "NoiseMechanism",
    "TreeAggregationMechanism",
    "make_mechanism",
    "register_mechanism",
]


class NoiseMechanism(Protocol):
    """What the private step asks of its noise stage, in the order it asks.

    ``source`` is where it draws from; replacing it (a zero source for a noiseless trial, a
    test's) keeps the mechanism's state.
    """

    source: NoiseSource

    def check(self, batch: DrawnBatch) -> None:
        """Refuse a batch this mechanism's accounting does not cover (nothing has changed yet)."""
        ...

    def opening(self) -> NoiseStart | None:
        """The noise each parameter's sum opens from in the engine, or None to add it after."""
        ...

    def sampling(self, record: SamplingRecord, batch: DrawnBatch) -> SamplingRecord:
        """The sampling record of this step as the ledger must account it."""
        ...

    def step_event(
        self, record: SamplingRecord, batch: DrawnBatch, noise_multiplier: float
    ) -> DpEvent | None:
        """The event this step is charged, or None: the sampling record's own event at σ.

        Asked once the step's record is known and before the budget guard, with nothing
        changed; a mechanism whose cost is not a per-step sampled event (correlated noise under
        a participation schema) states its share of the run's event here, and the ledger
        records exactly that (:class:`~dpfy.train.step_record.StepRecord` ``charged``).
        """
        ...

    def privatise(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The noisy gradients from this step's clipped sums; called once the step is allowed."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the noise exactly."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a state that is not this mechanism's."""
        ...


MechanismFactory = Callable[
    [PrivacyPlan, Mapping[str, torch.Tensor], NoiseSource, float], NoiseMechanism
]
#: Every registered mechanism by name; the matrix-factorisation ones register from their own
#: modules (:mod:`dpfy.train.noise.banded`, :mod:`.blt`), which the private step imports.
MECHANISMS: dict[str, MechanismFactory] = {}


def register_mechanism(name: str) -> Callable[[MechanismFactory], MechanismFactory]:
    """Register the factory of the mechanism a plan names ``name``."""

    def register(factory: MechanismFactory) -> MechanismFactory:
        MECHANISMS[name] = factory
        return factory

    return register


def make_mechanism(
    plan: PrivacyPlan, params: Mapping[str, torch.Tensor], source: NoiseSource, std: float
) -> NoiseMechanism:
    """The plan's noise mechanism over ``params`` drawing from ``source`` at ``std``."""
    if plan.mechanism not in MECHANISMS:
        raise ValueError(
            f"noise mechanism must be one of {', '.join(MECHANISMS)}; got {plan.mechanism!r}"
        )
    return MECHANISMS[plan.mechanism](plan, params, source, std)


@dataclass(frozen=True)
class _NoiseInto:
    """The engine's :class:`NoiseStart`: every parameter's sum opens from its noise, drawn now."""

    names: frozenset[str]
    source: NoiseSource
    std: float

    def fill(self, name: str, out: torch.Tensor) -> None:
        """Draw the noise of one parameter into the sum about to be opened."""
        fill_with_noise(self.source, out, self.std)

    def add(self, name: str, total: torch.Tensor) -> None:
        """Add the noise of one parameter into a sum formed on earlier physical batches."""
        total.add_(self.source.normal(total, self.std))


class GaussianMechanism:
    """Independent N(0, std²) per coordinate, every step, on every trainable parameter.

    The noise is drawn on the training thread, on the parameters' device, into each sum as the
    engine opens it (no parameter-sized temporary); DP-FedAvg's rounds open theirs the same way
    (:meth:`~dpfy.train.private_aggregation.PrivateAggregation.open_sums`).
    """

    def __init__(self, names: frozenset[str], source: NoiseSource, std: float) -> None:
        self.names = names
        self.source = source
        self.std = std

    def check(self, batch: DrawnBatch) -> None:
        """Any batch the private loader drew: the accounting holds for each on its own."""

    def opening(self) -> NoiseStart:
        """Each sum opens from its noise."""
        return _NoiseInto(self.names, self.source, self.std)

    def sampling(self, record: SamplingRecord, batch: DrawnBatch) -> SamplingRecord:
        """Every step is accounted as the sampler's record says."""
        return record

    def step_event(
        self, record: SamplingRecord, batch: DrawnBatch, noise_multiplier: float
    ) -> DpEvent | None:
        """None: independent noise costs what the sampling record's event says."""
        return None

    def privatise(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The sums already hold their noise (opened from it)."""
        return sums

    def state_dict(self) -> dict[str, Any]:
        """Stateless: independent noise carries nothing over a resume (the source starts a
        fresh stream, :meth:`~dpfy.train.noise.source.TorchNoise.reseed`)."""
        return {"mechanism": "gaussian"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Accept only a Gaussian mechanism's (empty) state."""
        _check_kind(state, "gaussian")


@register_mechanism("gaussian")
def _gaussian(
    plan: PrivacyPlan, params: Mapping[str, torch.Tensor], source: NoiseSource, std: float
) -> NoiseMechanism:
    """DP-SGD's noise (guide alg. 1)."""
    return GaussianMechanism(frozenset(params), source, std)


class TreeAggregationMechanism:
    """DP-FTRL's noise: tree-aggregated prefix sums, released as their step-to-step differences.

    Kairouz et al. 2021 (alg. 1; guide §4.3): with clipped sums g_1..g_t since the last restart,
    the release is the noisy prefix sum ŝ_t = g_1 + … + g_t + z_t, z_t the tree's noise on the
    prefix. The optimizer receives ŝ_t − ŝ_{t−1} = g_t + (z_t − z_{t−1}): with SGD at a constant
    learning rate that is θ_t = θ₀ − η·ŝ_t (FTRL with a quadratic regulariser centred on θ₀), with
    momentum the paper's DP-FTRLM; any other update is post-processing of the same releases. A
    restart (``plan.restart_every`` steps, an epoch by default) begins a fresh tree.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        source: NoiseSource,
        std: float,
        *,
        steps_per_epoch: int,
        restart_every: int,
        variant: str,
    ) -> None:
        self.tree = TreeNoise(params, std, source, variant)
        self.steps_per_epoch = steps_per_epoch
        self.restart_every = restart_every
        self.steps_done = 0
        self._released = {name: torch.zeros_like(p) for name, p in params.items()}

    @property
    def source(self) -> NoiseSource:
        """The tree's noise source."""
        return self.tree.noise

    @source.setter
    def source(self, source: NoiseSource) -> None:
        self.tree.noise = source

    def check(self, batch: DrawnBatch) -> None:
        """The batch must be the next of the epoch the trees follow.

        A batch skipped (a refused or failed step) would put the next epoch's batches into this
        epoch's last tree, where an example can sit twice — outside the bound the ledger charges
        (Kairouz et al. 2021, App. D).
        """
        expected = self.steps_done % self.steps_per_epoch
        if batch.epoch_position != expected:
            raise BatchRefused(
                f"DP-FTRL's trees are at batch {expected} of the epoch but the loader handed out "
                f"batch {batch.epoch_position}: a batch was skipped (a refused or failed step), "
                "so this step could put an example twice in one tree; reload the last "
                "checkpoint (PrivateTraining.load) and step on every batch in order"
            )

    def opening(self) -> None:
        """The noise is correlated across steps: it is added once the sums are complete."""
        return None

    def sampling(self, record: SamplingRecord, batch: DrawnBatch) -> SamplingRecord:
        """The sampler's record as it is (describing sampling only; the charge is
        :meth:`step_event`'s): DP-FTRL needs batches taken in order."""
        if record.kind not in TREE_KINDS:
            raise BatchRefused(
                f"DP-FTRL needs batches taken in order ('tree-shuffle' or 'tree-fixed-order'), "
                f"got {record.kind.value!r}"
            )
        return record

    def step_event(
        self, record: SamplingRecord, batch: DrawnBatch, noise_multiplier: float
    ) -> DpEvent | None:
        """One Gaussian of noise σ per tree node able to hold an example's gradient that this
        step newly releases (Kairouz et al. 2021, App. D): summed over a tree, ⌈log₂(T+1)⌉ of
        them; a step that releases no such node is charged nothing."""
        nodes = new_tree_nodes(batch.epoch_position + 1, self.restart_every)
        return tree_step_event(noise_multiplier, nodes)

    @torch.no_grad()
    def privatise(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """g_t + z_t − z_{t−1}, after restarting the tree at the start of each tree's span."""
        if self.steps_done % self.restart_every == 0:
            self.tree.reset()
            for released in self._released.values():
                released.zero_()
        prefix = self.tree.advance()
        noisy = {}
        for name, total in sums.items():
            noisy[name] = total.add_(prefix[name]).sub_(self._released[name])
            self._released[name] = prefix[name]
        self.steps_done += 1
        return noisy

    def state_dict(self) -> dict[str, Any]:
        """The tree, the noise released so far in it, and the steps taken."""
        return {
            "mechanism": "tree-aggregation",
            "steps_done": self.steps_done,
            "restart_every": self.restart_every,
            "tree": self.tree.state_dict(),
            "released": {name: t.clone() for name, t in self._released.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; another tree configuration or model is refused."""
        _check_kind(state, "tree-aggregation")
        if state.get("restart_every") != self.restart_every:
            raise ValueError(
                f"the state restarts every {state.get('restart_every')} steps, this run every "
                f"{self.restart_every}; resume with the same restart_every"
            )
        released = dict(state["released"])
        if set(released) != set(self._released) or any(
            released[n].shape != self._released[n].shape for n in released
        ):
            raise ValueError("the DP-FTRL state is for other parameters than this model's")
        self.tree.load_state_dict(state["tree"])
        self._released = {  # onto the parameters' devices (checkpoints load on the CPU)
            name: t.to(self._released[name], copy=True) for name, t in released.items()
        }
        self.steps_done = int(state["steps_done"])


@register_mechanism("tree-aggregation")
def _tree_aggregation(
    plan: PrivacyPlan, params: Mapping[str, torch.Tensor], source: NoiseSource, std: float
) -> NoiseMechanism:
    """DP-FTRL's noise with the plan's restart period and tree estimator."""
    assert plan.restart_every is not None and plan.tree is not None  # set by the resolver
    return TreeAggregationMechanism(
        params,
        source,
        std,
        steps_per_epoch=plan.dataset_size // plan.expected_batch_size,
        restart_every=plan.restart_every,
        variant=plan.tree,
    )


def _check_kind(state: Any, kind: str) -> None:
    """A mechanism state must be of this mechanism."""
    saved = state.get("mechanism") if isinstance(state, Mapping) else None
    if saved != kind:
        raise ValueError(
            f"the checkpoint's noise state is for the {saved!r} mechanism, this run uses {kind!r}"
        )
