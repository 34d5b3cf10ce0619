"""The vmap engine: per-example gradients of each watched layer from ``torch.func``.

Works for any layer that acts on each example separately (it needs no rule): hooks keep each
layer call's inputs and output gradients, and ``vmap`` over examples of a ``vjp`` through
``functional_call`` gives every example's gradient of that layer's own parameters. Per-example
gradients are materialised (memory ∝ batch × parameters), summed across repeated calls and
shared parameters, clipped and summed. The general fallback, and the reference in tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call, vjp, vmap

from dpfy.grads.capture import Call, Tap, output_tensors
from dpfy.grads.engine import GradEngine
from dpfy.grads.layout import pad_batch

__all__ = ["VmapEngine", "per_example_grads"]


def per_example_grads(tap: Tap, call: Call, batch_dim: int) -> dict[str, Tensor]:
    """Each example's gradient of the layer's own trainable parameters, (B, *shape) by name."""
    module = tap.module
    n = call.inputs[0].shape[batch_dim]
    params = {name: getattr(module, name).detach() for name in sorted(tap.trainable)}
    in_dims = tuple(
        batch_dim
        if isinstance(x, Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == n
        else None
        for x in call.inputs
    )
    grads = tuple(
        g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        for g, (shape, dtype, device) in zip(call.grads, call.out_meta, strict=True)
    )

    def one_example(p: dict[str, Tensor], xs: tuple[Any, ...], gs: tuple[Tensor, ...]) -> Any:
        batched = tuple(
            x.unsqueeze(batch_dim) if d is not None else x for x, d in zip(xs, in_dims, strict=True)
        )

        def outputs(q: dict[str, Tensor]) -> tuple[Tensor, ...]:
            every = list(output_tensors(functional_call(module, q, batched)))
            return tuple(every[j] for j in call.out_index)

        _, pullback = vjp(outputs, p)
        return pullback(tuple(g.unsqueeze(batch_dim) for g in gs))[0]

    return vmap(one_example, in_dims=(None, in_dims, (batch_dim,) * len(grads)))(
        params, call.inputs, grads
    )


class VmapEngine(GradEngine):
    """Per-example clipping from materialised per-example gradients (any per-example layer)."""

    kind = "vmap"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Same arguments as :class:`GradEngine`."""
        super().__init__(*args, **kwargs)
        self._units: dict[str, Tensor] = {}

    def _unit_sq_norms(self, calls: list[tuple[Tap, Call]], n: int, group: int) -> Tensor:
        """Per-example gradients, summed over calls and shared uses, grouped into units."""
        per: dict[str, Tensor] = {}
        for tap, call in calls:
            for local, grad in per_example_grads(tap, call, self.batch_dim(tap, call)).items():
                name = self._names[id(getattr(tap.module, local))]
                per[name] = per[name] + grad if name in per else grad
        units = -(-n // group)
        self._units = {
            name: pad_batch(g, units * group).reshape(units, group, *g.shape[1:]).sum(1)
            for name, g in per.items()
        }
        return sum(g.flatten(1).square().sum(1) for g in self._units.values())

    def _unit_weighted_sums(self, weights: Tensor) -> dict[str, Tensor]:
        """Σ_u w_u grad_u for every parameter from the kept per-unit gradients."""
        try:
            return {
                name: torch.tensordot(weights.to(g.dtype), g, dims=1)
                for name, g in self._units.items()
            }
        finally:
            self._units = {}
