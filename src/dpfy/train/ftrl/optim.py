"""DPFTRLOptimizer: DP-FTRL with tree-aggregation noise, on dpfy's per-example clipping engines.

Kairouz, McMahan, Song, Thakkar, Thakurta & Xu 2021, alg. 1 (guide §4.3, tab. 3). With the
clipped gradient sums g_1, g_2, … of the steps since the last restart and their noisy prefix sum
ŝ_t = g_1 + … + g_t + tree noise (:class:`~dpfy.train.noise.tree.TreeNoise`), the update is FTRL
with a
quadratic regulariser centred on the parameters θ₀ at the restart:

    θ_t = θ₀ − η · ŝ_t / B,

B the batch size (the sum of clipped gradients over B is an average, as in DP-SGD). With momentum
γ > 0 (the paper's DP-FTRLM) the noisy gradients ŝ_t − ŝ_{t−1} drive heavy-ball momentum,
v_t = γ v_{t−1} + (ŝ_t − ŝ_{t−1}), θ_t = θ_{t−1} − η v_t / B — pure post-processing of the released
prefix sums; γ = 0 is the formula above. A restart (every epoch by default) re-centres θ₀ on the
current parameters and starts a fresh tree. The wrapped optimizer must be ``torch.optim.SGD``:
it supplies the parameter groups, learning rates (schedulers work) and momentum.

Each step is recorded in the ledger before it is applied, as the number of new tree nodes that
could hold an example's gradient (:mod:`dpfy.plan.tree_events`); a step that releases one is
refused by the budget guard if it would exceed the target, and a step that releases none costs
nothing and cannot exceed it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from dpfy.data.provenance import BatchRefused, DrawnBatch, Provenance
from dpfy.plan.accounting.events import tree_aggregation_reason
from dpfy.plan.sampling import TREE_KINDS, SamplingRecord
from dpfy.plan.tree_events import new_tree_nodes, resolve_restart
from dpfy.train.grads import GradEngine, LossReduction
from dpfy.train.ledger import PrivacyLedger, StepRecord
from dpfy.train.noise.source import NoiseSource
from dpfy.train.noise.tree import TreeNoise
from dpfy.train.optim import BatchBoundary, DPOptimizer, NoiseSettings, NonFiniteGradientError

_STATE_VERSION = 1


def check_sgd(optimizer: torch.optim.Optimizer) -> None:
    """DP-FTRL replaces the update rule: only plain SGD (lr, momentum) maps onto it."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            f"DP-FTRL needs a torch.optim.SGD (learning rate and momentum), got "
            f"{type(optimizer).__name__}; build torch.optim.SGD(model.parameters(), lr=…, "
            "momentum=…) or train with DP-SGD to use another optimizer"
        )
    for group in optimizer.param_groups:
        extras = {
            "weight_decay": group.get("weight_decay", 0) != 0,
            "dampening": group.get("dampening", 0) != 0,
            "nesterov": bool(group.get("nesterov", False)),
            "maximize": bool(group.get("maximize", False)),
        }
        used = [name for name, on in extras.items() if on]
        if used:
            raise ValueError(
                f"DP-FTRL supports SGD with lr and momentum only; this SGD sets {', '.join(used)}: "
                "remove them"
            )


class DPFTRLOptimizer(DPOptimizer):
    """``step()`` clips, adds this step's tree noise to the prefix sum, accounts and updates.

    ``restart_every``: "epoch" (default) or a divisor of the steps per epoch (N // B, from the
    sampling record); ``tree``: "efficient" (Honaker 2015, default) or "plain".
    """

    def __init__(
        self,
        optimizer: torch.optim.SGD,
        engine: GradEngine,
        ledger: PrivacyLedger,
        sampling: SamplingRecord,
        settings: NoiseSettings,
        *,
        restart_every: int | str | None = "epoch",
        tree: str = "efficient",
        provenance: Provenance,
        loss_reduction: LossReduction = "mean",
        noise: NoiseSource | None = None,
        boundary: BatchBoundary | None = None,
    ) -> None:
        check_sgd(optimizer)
        if not isinstance(sampling, SamplingRecord) or sampling.kind not in TREE_KINDS:
            kind = getattr(getattr(sampling, "kind", None), "value", sampling)
            raise ValueError(
                f"DP-FTRL needs batches taken in order, each example once per epoch (sampling "
                f"'tree-shuffle' or 'tree-fixed-order', from dpfy.train.ftrl.OrderedSampler), got "
                f"{kind!r}; DP-FTRL assumes no sampling, so Poisson batches bring nothing here"
            )
        reason = tree_aggregation_reason(ledger.relation)
        if reason is not None:  # each step is a plain GaussianEvent: the ledger would not refuse
            raise ValueError(f"{reason}: PrivacyLedger(delta, relation='zero-out')")
        super().__init__(
            optimizer,
            engine,
            ledger,
            sampling,
            settings,
            provenance=provenance,
            loss_reduction=loss_reduction,
            noise=noise,
            boundary=boundary,
        )
        self.steps_per_epoch = sampling.dataset_size // sampling.batch_size
        self.restart_every = resolve_restart(restart_every, self.steps_per_epoch)
        params = {name: p.detach() for name, p in engine.params.items()}
        self.tree = TreeNoise(params, settings.noise_std, self.noise, tree)
        self._names = {id(p): name for name, p in engine.params.items()}
        self._anchor = {name: p.clone() for name, p in params.items()}
        self._sum = {name: torch.zeros_like(p) for name, p in params.items()}
        self._previous = {name: torch.zeros_like(p) for name, p in params.items()}
        self._velocity = {name: torch.zeros_like(p) for name, p in params.items()}
        self.steps_done = 0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Clip this batch; at the end of a logical batch, account, add tree noise and update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batch = self._guarded(self._in_tree_order)
        result = self._guarded(self._clip, batch)
        for observe in self.clip_observers:  # diagnostics only
            observe(result)
        if not bool(torch.isfinite(result.norms).all()):
            self._abandon()
            raise NonFiniteGradientError(
                "a per-example gradient is NaN or infinite (a non-finite loss?); the step was not "
                "applied and the model and ledger are unchanged — check the inputs and the loss, "
                "or lower the learning rate; DP-FTRL cannot skip a batch, so reload the last "
                "checkpoint before training on"
            )
        if not self.boundary.closes_batch:
            return loss
        position = batch.epoch_position + 1
        nodes = new_tree_nodes(position, self.restart_every)
        record = StepRecord(
            dataclasses.replace(self.sampling, tree_nodes=nodes),
            self.settings.noise_multiplier,
            batch_size=self.engine.num_examples,
        )
        self._guarded(self.provenance.check_size, batch, self.engine.num_examples)
        if nodes:  # a step releasing no new node costs nothing and cannot exceed the budget
            self._guarded(self.ledger.check_step, record)
        self._update(self.engine.summed_grads(), restart=(position - 1) % self.restart_every == 0)
        self.ledger.record(record)
        self.provenance.consume(batch)
        self.engine.reset()
        self.steps_done += 1
        return loss

    def _in_tree_order(self) -> DrawnBatch:
        """The drawn batch, which must be the next one of the epoch the trees are following.

        The trees restart at the sampler's epoch positions; a batch skipped (a refused step) or
        a step without a fresh batch would put the next epoch's batches into this epoch's last
        tree, where an example can sit twice — outside the tree bound the ledger charges
        (Kairouz et al. 2021, App. D).
        """
        batch = self._checked_batch()
        expected = self.steps_done % self.steps_per_epoch
        if batch.epoch_position != expected:
            raise BatchRefused(
                f"DP-FTRL's trees are at batch {expected} of the epoch but the loader handed out "
                f"batch {batch.epoch_position}: a batch was skipped (a refused or failed step), "
                "so this step could put an example twice in one tree; reload the last "
                "checkpoint (PrivateTraining.load) and step on every batch in order"
            )
        return batch

    @torch.no_grad()
    def _update(self, summed: dict[str, torch.Tensor], *, restart: bool) -> None:
        """θ = θ₀ − η·ŝ_t/B (or momentum on ŝ_t − ŝ_{t−1}); a restart re-centres and resets."""
        if restart:
            self.tree.reset()
            for name, p in self.engine.params.items():
                self._anchor[name].copy_(p)
                self._sum[name].zero_()
                self._previous[name].zero_()
        noise = self.tree.advance()
        divisor = self.settings.divisor
        for group in self.param_groups:
            lr, momentum = group["lr"], group.get("momentum", 0.0)
            for p in group["params"]:
                name = self._names.get(id(p))
                if name is None:  # frozen: never touched (DESIGN rule 2)
                    continue
                self._sum[name].add_(summed[name])
                noisy = self._sum[name] + noise[name]
                if momentum == 0:
                    p.copy_(self._anchor[name] - noisy * (lr / divisor))
                else:
                    self._velocity[name].mul_(momentum).add_(noisy - self._previous[name])
                    p.add_(self._velocity[name], alpha=-lr / divisor)
                self._previous[name] = noisy

    def state_dict(self) -> dict[str, Any]:
        """SGD's state plus the tree, the anchor θ₀, the clipped prefix sum and the step count."""
        return {
            "sgd": self.original_optimizer.state_dict(),
            "ftrl": {
                "version": _STATE_VERSION,
                "steps_done": self.steps_done,
                "restart_every": self.restart_every,
                "tree": self.tree.state_dict(),
                "anchor": {k: v.clone() for k, v in self._anchor.items()},
                "sum": {k: v.clone() for k, v in self._sum.items()},
                "previous": {k: v.clone() for k, v in self._previous.items()},
                "velocity": {k: v.clone() for k, v in self._velocity.items()},
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state of another configuration is refused (ValueError)."""
        ftrl = state_dict.get("ftrl") if isinstance(state_dict, dict) else None
        if not isinstance(ftrl, dict) or ftrl.get("version") != _STATE_VERSION:
            raise ValueError("not a DP-FTRL optimizer state (was it saved by DP-SGD?)")
        if ftrl["restart_every"] != self.restart_every:
            raise ValueError(
                f"the state restarts every {ftrl['restart_every']} steps, this optimizer every "
                f"{self.restart_every}; resume with the same restart_every"
            )
        tensors = {key: dict(ftrl[key]) for key in ("anchor", "sum", "previous", "velocity")}
        for key, values in tensors.items():
            if set(values) != set(self._anchor) or any(
                values[n].shape != self._anchor[n].shape for n in values
            ):
                raise ValueError(f"DP-FTRL state '{key}' is for other parameters")
        self.tree.load_state_dict(ftrl["tree"])
        super().load_state_dict(state_dict["sgd"])
        self._anchor, self._sum = tensors["anchor"], tensors["sum"]
        self._previous, self._velocity = tensors["previous"], tensors["velocity"]
        self.steps_done = int(ftrl["steps_done"])

    def __repr__(self) -> str:
        """The privacy settings and the tree configuration."""
        s = self.settings
        return (
            f"DPFTRLOptimizer(σ={s.noise_multiplier:.4g}, C={s.max_grad_norm:.4g}, "
            f"B={s.expected_batch_size:g}, restart_every={self.restart_every}, "
            f"tree={self.tree.variant}, engine={self.engine.kind})"
        )
