"""The private part of one federated round: clip each user's model change, sum, noise, average.

Shared by the in-process DP-FedAvg trainer and the Flower adapter, so both give the same
guarantee (guide alg. 2, §4.4; McMahan et al. 2018, "Learning differentially private recurrent
language models"):

* each user's change Δ_u (over *all* trainable parameters together) is scaled to L2 norm ≤ C;
* the clipped changes are summed and ``N(0, σ²C²)`` is added once per coordinate of the sum;
* the noisy sum is divided by the **expected** number of users per round B_c = qN, never by the
  number that actually took part (the realised count is data-dependent);
* a malformed or non-finite change is dropped and counts as zero. That is always safe: under
  add/remove-one-user adjacency a user's contribution may be any vector of norm ≤ C, zero
  included, so the sensitivity stays C.

Applying the noisy average with a server optimizer is post-processing (guide §4.2, §5.5.2):
:class:`ServerUpdate` sets ``p.grad = −update`` and steps any torch optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dpfy._validate import check_positive
from dpfy.train.noise.mechanisms import GaussianMechanism
from dpfy.train.noise.source import NoiseSource

__all__ = [
    "SERVER_OPTIMIZERS",
    "ClippedSum",
    "MalformedUpdate",
    "ServerUpdate",
    "clip_update",
    "make_server_optimizer",
]


class MalformedUpdate(ValueError):
    """A user's update has the wrong tensors, shapes or non-finite values; it is dropped."""


def clip_update(
    delta: Mapping[str, torch.Tensor], clip_norm: float
) -> tuple[dict[str, torch.Tensor], float]:
    """Δ · min(1, C/‖Δ‖) over all tensors together, and the unclipped norm ‖Δ‖ (guide alg. 2)."""
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))
    factor = clip_norm / max(norm, clip_norm)  # 1 when ‖Δ‖ ≤ C; never divides by zero
    return {name: t * factor for name, t in delta.items()}, norm


class ClippedSum:
    """Running sum of clipped user updates, shaped like the model's trainable parameters."""

    def __init__(self, like: Mapping[str, torch.Tensor], clip_norm: float) -> None:
        self.clip_norm = check_positive("clip_norm", clip_norm)
        self.total = {name: torch.zeros_like(t) for name, t in like.items()}
        self.accepted = 0
        self.norms: list[float] = []

    def add(self, delta: Mapping[str, torch.Tensor]) -> float:
        """Clip ``delta`` to C and add it; returns its norm before clipping.

        Raises :class:`MalformedUpdate` (and adds nothing) for missing or extra tensors, a wrong
        shape, or a NaN/inf value.
        """
        checked = self._validate(delta)
        clipped, norm = clip_update(checked, self.clip_norm)
        for name, value in clipped.items():
            self.total[name].add_(value)
        self.accepted += 1
        self.norms.append(norm)
        return norm

    def _validate(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The update as tensors matching the model's, or MalformedUpdate naming the problem."""
        if not isinstance(delta, Mapping):
            raise MalformedUpdate(f"an update must map tensor names to tensors, got {delta!r}")
        missing, extra = set(self.total) - set(delta), set(delta) - set(self.total)
        if missing or extra:
            raise MalformedUpdate(
                f"update tensors do not match the model: missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}"
            )
        checked = {}
        for name, reference in self.total.items():
            try:
                value = torch.as_tensor(delta[name])
            except (TypeError, ValueError, RuntimeError):
                raise MalformedUpdate(f"update tensor {name!r} is not numeric") from None
            if value.shape != reference.shape:
                raise MalformedUpdate(
                    f"update tensor {name!r} has shape {tuple(value.shape)}, the model's has "
                    f"{tuple(reference.shape)}"
                )
            if not value.is_floating_point():
                raise MalformedUpdate(f"update tensor {name!r} is not finite floating point")
            value = value.to(dtype=reference.dtype, device=reference.device)
            if not bool(torch.isfinite(value).all()):  # after the cast: 1e300 → inf in float32
                raise MalformedUpdate(
                    f"update tensor {name!r} is not finite floating point in the model's "
                    f"{reference.dtype}"
                )
            checked[name] = value
        return checked

    def noisy_mean(
        self, noise: NoiseSource, noise_multiplier: float, expected_users: float
    ) -> dict[str, torch.Tensor]:
        """(Σ clipped Δ + N(0, σ²C²)) / B_c, with B_c the expected user count.

        The noise stage is DP-SGD's (:class:`~dpfy.train.noise.mechanisms.GaussianMechanism`),
        at the divisor's scale like the private step's: std σC/B_c on the sum ÷ B_c.
        """
        std = check_positive("noise_multiplier", noise_multiplier) * self.clip_norm
        divisor = check_positive("expected_users", expected_users)
        mean = {name: total / divisor for name, total in self.total.items()}
        GaussianMechanism(frozenset(mean), noise, std / divisor).add_to(mean)
        return mean


# -- the server update: post-processing with any torch optimizer ----------------------------------

OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]

SERVER_OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
}


def make_server_optimizer(
    name: str, params: Iterable[nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    """A registered server optimizer ('sgd', 'momentum', 'adam') at server learning rate η_s."""
    key = str(name).strip().lower()
    if key not in SERVER_OPTIMIZERS:
        raise ValueError(
            f"server optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}; got {name!r} "
            "(or pass any torch optimizer over the model's trainable parameters)"
        )
    return SERVER_OPTIMIZERS[key](params, check_positive("server_lr", lr))


@dataclass
class ServerUpdate:
    """Applies a noisy average model change with a torch optimizer: ``p.grad = −update``.

    With plain SGD at lr η_s this is θ ← θ + η_s · mean Δ, the guide's alg. 2 update; momentum
    or Adam only post-process the privatised average (guide §4.2).
    """

    params: dict[str, nn.Parameter]
    optimizer: torch.optim.Optimizer

    def apply(self, update: Mapping[str, torch.Tensor]) -> None:
        """One optimizer step in the direction of ``update``; gradients are cleared after."""
        for name, param in self.params.items():
            param.grad = -update[name].to(dtype=param.dtype, device=param.device)
        self.optimizer.step()
        for param in self.params.values():
            param.grad = None
