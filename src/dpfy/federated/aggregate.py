"""The private part of one federated round: clip each user's model change, sum, noise, average.

Shared by the in-process DP-FedAvg trainer and the Flower adapter, so both give the same
guarantee (guide alg. 2, §4.4; McMahan et al. 2018, "Learning differentially private recurrent
language models"):

* each user's change Δ_u (over *all* trainable parameters together) is scaled to L2 norm ≤ C;
* the clipped changes are summed and ``N(0, σ²C²)`` is added once per coordinate of the sum;
* the noisy sum is divided by the **expected** number of users per round B_c = qN, never by the
  number that actually took part (the realised count is data-dependent);
* these three are the private step's own aggregation
  (:class:`~dpfy.train.private_aggregation.PrivateAggregation`), which DP-SGD's step releases
  through too: the sum opens from its noise at 1/B_c and each clipped change is added at 1/B_c;
* a malformed or non-finite change is dropped and counts as zero. That is always safe: under
  add/remove-one-user adjacency a user's contribution may be any vector of norm ≤ C, zero
  included, so the sensitivity stays C.

Applying the noisy average with a server optimizer is post-processing (guide §4.2, §5.5.2):
:class:`ServerUpdate` sets ``p.grad = −update`` and steps any torch optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dpfy._validate import check_positive
from dpfy.train.private_aggregation import PrivateAggregation
from dpfy.train.private_aggregation import clip_unit as clip_update

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


class ClippedSum:
    """One round's private sum of clipped user updates, shaped like the trainable parameters.

    It opens from the aggregation's noise, so the round's release (:meth:`noisy_mean`) is the
    same step DP-SGD takes: (noise + Σ clipped Δ) / B_c.
    """

    def __init__(
        self,
        like: Mapping[str, torch.Tensor],
        clip_norm: float,
        aggregation: PrivateAggregation,
    ) -> None:
        self.clip_norm = check_positive("clip_norm", clip_norm)
        self.aggregation = aggregation
        self.total = aggregation.open_sums(like)
        self.accepted = 0
        self.norms: list[float] = []

    def add(self, delta: Mapping[str, torch.Tensor]) -> float:
        """Clip ``delta`` to C and add it; returns its norm before clipping.

        Raises :class:`MalformedUpdate` (and adds nothing) for missing or extra tensors, a wrong
        shape, or a NaN/inf value.
        """
        norm = self.aggregation.add_clipped(self.total, self._validate(delta), self.clip_norm)
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

    def noisy_mean(self) -> dict[str, torch.Tensor]:
        """(Σ clipped Δ + N(0, σ²C²)) / B_c, with B_c the expected user count."""
        return self.aggregation.release(self.total)


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
