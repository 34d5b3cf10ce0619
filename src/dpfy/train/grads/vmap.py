"""The vmap engine: per-example gradients of each watched layer from ``torch.func``.

Works for any layer that acts on each example separately (it needs no rule): hooks keep each
layer call's inputs and output gradients, and ``vmap`` over examples of a ``vjp`` through
``functional_call`` gives every example's gradient of that layer's own parameters, one layer at a
time (memory ∝ batch × that layer's parameters), summed across repeated calls and shared
parameters. Their norms give the clip weights; the clipped sum is then one ordinary ``vjp`` per
layer call with weighted output gradients. The general fallback, and the reference in tests.

A layer that ran under ``torch.autocast`` is replayed under the same autocast, so its per-example
gradients are computed in the precision the model used; norms and clipped sums are then formed
in float32 at least (:mod:`dpfy.train.grads.precision`). In half precision the clipped sum is
formed from the per-example gradients (formed a second time, layer by layer) rather than by a
vjp whose clip weights and sum would be rounded to the half-precision outputs' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call, vjp, vmap

from dpfy.train.grads.capture import Call, Tap, output_tensors
from dpfy.train.grads.engine import GradEngine
from dpfy.train.grads.layout import Units
from dpfy.train.grads.norms import sq_norm
from dpfy.train.grads.precision import autocast_as, compute_dtype, is_low

__all__ = ["VmapEngine", "per_example_grads", "weighted_grads"]

#: How far (relatively, in norm) a gradient may stray from the sum of per-example gradients in
#: float arithmetic; a use outside the watched calls moves it by its own contribution. In half
#: precision the two sums round differently by a few units of roundoff, so the bound is
#: ``_HALF_ROUNDINGS`` machine epsilons there. A gradient that is zero but for rounding (the
#: key bias of attention) is compared with the whole step's gradient instead (``_STEP_ROUNDINGS``
#: epsilons of its norm).
_TOLERANCE = 1e-3
_HALF_ROUNDINGS = 4
_STEP_ROUNDINGS = 64
_FLOOR = 1e-12


def _replay(call: Call) -> Any:
    """The autocast the call ran under, to replay the layer in the same precision."""
    return autocast_as(call.out_meta[0][2].type, call.autocast)


def _cotangents(grads: tuple[Tensor, ...], outs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Output gradients in the dtypes of the replayed outputs (autocast may have changed them)."""
    return tuple(
        g if g.dtype == o.dtype else g.to(o.dtype) for g, o in zip(grads, outs, strict=True)
    )


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

        outs, pullback = vjp(outputs, p)
        return pullback(_cotangents(tuple(g.unsqueeze(batch_dim) for g in gs), outs))[0]

    with _replay(call):
        return vmap(one_example, in_dims=(None, in_dims, (batch_dim,) * len(grads)))(
            params, call.inputs, grads
        )


def weighted_grads(tap: Tap, call: Call, batch_dim: int, weights: Tensor) -> dict[str, Tensor]:
    """Σ_i w_i · (example i's gradient), by name: one ordinary vjp with scaled output gradients.

    The layer acts on each example separately, so the gradient of Σ_i ⟨f(x_i), w_i g_i⟩ is the
    weighted sum of per-example gradients (book-keeping, Bu et al. 2023) — none is formed.
    """
    module = tap.module
    params = {name: getattr(module, name).detach() for name in sorted(tap.trainable)}

    def scaled(g: Tensor | None, meta: tuple) -> Tensor:
        g = g if g is not None else torch.zeros(meta[0], dtype=meta[1], device=meta[2])
        view = [1] * g.dim()
        view[batch_dim] = -1
        return g * weights.to(g.dtype).view(view)

    def outputs(q: dict[str, Tensor]) -> tuple[Tensor, ...]:
        every = list(output_tensors(functional_call(module, q, call.inputs)))
        return tuple(every[j] for j in call.out_index)

    with _replay(call):
        outs, pullback = vjp(outputs, params)
        cotangents = tuple(scaled(g, m) for g, m in zip(call.grads, call.out_meta, strict=True))
        return pullback(_cotangents(cotangents, outs))[0]


class VmapEngine(GradEngine):
    """Per-example clipping from per-example gradients formed layer by layer (any layer).

    Norms: each layer's per-example gradients are formed with ``vmap`` and reduced to squared
    norms at once (kept only for parameters shared between layers or calls, which must be summed
    first). Clipped sum: one batched ``vjp`` per layer call with output gradients scaled by the
    clip weights. Peak memory is one layer's per-example gradients, not the whole model's.
    """

    kind = "vmap"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Same arguments as :class:`GradEngine`."""
        super().__init__(*args, **kwargs)
        self._calls: list[tuple[Tap, Call]] = []
        self._units: Units | None = None

    def _unit_sq_norms(self, calls: list[tuple[Tap, Call]], units: Units) -> Tensor:
        """Per-unit squared norms, layer by layer; shared parameters summed before squaring."""
        uses: dict[str, int] = {}
        for tap, _ in calls:
            for local in tap.trainable:
                name = self._names[id(getattr(tap.module, local))]
                uses[name] = uses.get(name, 0) + 1
        total: Tensor | None = None
        shared: dict[str, Tensor] = {}
        batch_sums: dict[str, Tensor] = {}

        def add(sq: Tensor) -> None:
            nonlocal total
            total = sq if total is None else total + sq

        for tap, call in calls:
            for local, grad in per_example_grads(tap, call, self.batch_dim(tap, call)).items():
                name = self._names[id(getattr(tap.module, local))]
                grad = grad.to(compute_dtype(grad.dtype))  # norms and sums in float32 at least
                summed = grad.sum(0)
                batch_sums[name] = batch_sums[name] + summed if name in batch_sums else summed
                if uses[name] > 1:
                    shared[name] = shared[name] + grad if name in shared else grad
                else:
                    add(sq_norm(units.sum_rows(grad).flatten(1), 1))
        for grad in shared.values():
            add(sq_norm(units.sum_rows(grad).flatten(1), 1))
        self._calls, self._units = list(calls), units
        self._check_complete(batch_sums)
        assert total is not None
        return total

    def _check_complete(self, batch_sums: dict[str, Tensor]) -> None:
        """Refuse a parameter whose per-example gradients do not add up to its gradient.

        Autograd's gradient of a parameter covers every use of it; the per-example gradients
        cover its uses inside the watched layer calls. They differ when the parameter is also
        used elsewhere (``F.linear(h, embedding.weight)``): its per-example gradient is unknown.
        """
        dtypes = [meta[1] for _, call in self._calls for meta in call.out_meta]
        dtypes += [param.dtype for param in self.params.values()]
        eps = max(torch.finfo(d).eps for d in dtypes if d.is_floating_point)
        tolerance = (
            max(_TOLERANCE, _HALF_ROUNDINGS * eps) if any(map(is_low, dtypes)) else _TOLERANCE
        )
        step = sum(float(value.double().square().sum()) for value in batch_sums.values()) ** 0.5
        floor = _FLOOR + _STEP_ROUNDINGS * eps * step
        for name, param in self.params.items():
            if not self._grad_changed(param):
                continue
            seen = batch_sums.get(name)
            full = param.grad.detach().reshape(param.shape).to(compute_dtype(param.dtype))
            seen = torch.zeros_like(full) if seen is None else seen.reshape(full.shape)
            gap = float((full - seen.to(full.dtype)).norm())
            if gap > tolerance * max(float(full.norm()), float(seen.norm())) + floor:
                raise RuntimeError(
                    f"parameter '{name}' is also used outside the layer that owns it (its "
                    "gradient is larger than the sum of its per-example gradients in that layer, "
                    "e.g. a weight reused through torch.nn.functional); its per-example gradient "
                    "is unknown. Use it only through its layer, or wrap the reuse in a module "
                    "that owns the parameter"
                )

    def _unit_weighted_sums(self, weights: Tensor) -> dict[str, Tensor]:
        """Σ_u w_u grad_u for every parameter: one scaled vjp per layer call.

        A call in half precision (autocast, or half-precision weights) instead sums its
        per-example gradients, formed again, in float32 (see the module docstring).
        """
        assert self._units is not None
        per_example = self._units.expand(weights)
        out: dict[str, Tensor] = {}
        try:
            for tap, call in self._calls:
                bd = self.batch_dim(tap, call)
                n = call.inputs[0].shape[bd]
                if _in_half_precision(tap, call):
                    sums = {
                        local: torch.tensordot(
                            per_example[:n].to(compute_dtype(grad.dtype)),
                            grad.to(compute_dtype(grad.dtype)),
                            dims=1,
                        )
                        for local, grad in per_example_grads(tap, call, bd).items()
                    }
                else:
                    sums = weighted_grads(tap, call, bd, per_example[:n])
                for local, value in sums.items():
                    name = self._names[id(getattr(tap.module, local))]
                    out[name] = out[name] + value if name in out else value
        finally:
            self._calls, self._units = [], None
        return out


def _in_half_precision(tap: Tap, call: Call) -> bool:
    """Whether the call ran in half precision (under autocast, or on half-precision weights)."""
    if call.autocast is not None and is_low(call.autocast):
        return True
    return any(is_low(meta[1]) for meta in call.out_meta) or any(
        is_low(getattr(tap.module, name).dtype) for name in tap.trainable
    )
