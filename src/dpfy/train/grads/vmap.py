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

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap
from torch.utils import _pytree as pytree

from dpfy.train.grads.capture import Call, Tap
from dpfy.train.grads.dropout import replaying
from dpfy.train.grads.engine import GradEngine
from dpfy.train.grads.hooks import refuse_gradient_hooks
from dpfy.train.grads.layout import Units
from dpfy.train.grads.norms import sq_norm
from dpfy.train.grads.precision import autocast_as, compute_dtype, is_low
from dpfy.train.grads.replay import Piece, ReplayPlan, bare_call, replay_plan

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
    """Each example's gradient of the layer's own trainable parameters, (B, *shape) by name.

    The call is replayed piece by piece (:func:`dpfy.train.grads.replay.replay_plan`): one
    ``vmap`` of a single-example ``vjp`` per piece, its rows written where its examples sit.
    """
    plan = _detached(replay_plan(tap, call, batch_dim))
    params = {name: getattr(tap.module, name).detach() for name in sorted(tap.trainable)}
    with _replay(call), _randomness_named(tap), torch.enable_grad():
        if len(plan.pieces) == 1 and plan.pieces[0].rows is None:
            return _piece_grads(tap.module, params, plan.pieces[0])
        out: dict[str, Tensor] = {}
        for piece in plan.pieces:
            grads = _piece_grads(tap.module, params, piece)
            for name, grad in grads.items():
                if name not in out:
                    out[name] = grad.new_zeros((plan.size, *grad.shape[1:]))
                out[name][piece.rows.to(grad.device)] = grad
        return out


def _piece_grads(module: nn.Module, params: dict[str, Tensor], piece: Piece) -> dict[str, Tensor]:
    """Per-example gradients of one piece: vmap over its examples of a one-example vjp."""

    def unsqueeze(x: Any, d: int | None) -> Any:
        return x.unsqueeze(d) if d is not None else x

    def one_example(
        p: dict[str, Tensor],
        xs: tuple[Any, ...],
        kw: dict[str, Any],
        gs: tuple[Tensor, ...],
        ms: tuple[Tensor, ...],
    ) -> Any:
        args = pytree.tree_map(unsqueeze, xs, piece.arg_dims)
        kwargs = pytree.tree_map(unsqueeze, kw, piece.kwarg_dims)
        masks = tuple(m.unsqueeze(d) for m, d in zip(ms, piece.mask_dims, strict=True))

        def outputs(q: dict[str, Tensor]) -> tuple[Tensor, ...]:
            with replaying(masks):
                return piece.pick(bare_call(module, q, args, kwargs))

        outs, pullback = vjp(outputs, p)
        cotangents = tuple(g.unsqueeze(d) for g, d in zip(gs, piece.grad_dims, strict=True))
        return pullback(_cotangents(cotangents, outs))[0]

    in_dims = (None, piece.arg_dims, piece.kwarg_dims, piece.grad_dims, piece.mask_dims)
    with warnings.catch_warnings():  # torch's note that an op (the CPU LSTM) has no batching
        warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE)  # rule: nothing to act on
        return vmap(one_example, in_dims=in_dims)(
            params, piece.args, piece.kwargs, piece.grads, piece.masks
        )


_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented"


def weighted_grads(tap: Tap, call: Call, batch_dim: int, weights: Tensor) -> dict[str, Tensor]:
    """Σ_i w_i · (example i's gradient), by name: one ordinary vjp with scaled output gradients.

    The layer acts on each example separately, so the gradient of Σ_i ⟨f(x_i), w_i g_i⟩ is the
    weighted sum of per-example gradients (book-keeping, Bu et al. 2023) — none is formed.
    """
    plan = _detached(replay_plan(tap, call, batch_dim))
    params = {name: getattr(tap.module, name).detach() for name in sorted(tap.trainable)}
    total: dict[str, Tensor] = {}
    with _replay(call), _randomness_named(tap), torch.enable_grad():
        for piece in plan.pieces:
            w = weights if piece.rows is None else weights[piece.rows.to(weights.device)]

            def outputs(q: dict[str, Tensor], piece: Piece = piece) -> tuple[Tensor, ...]:
                with replaying(piece.masks):
                    return piece.pick(bare_call(tap.module, q, piece.args, piece.kwargs))

            outs, pullback = vjp(outputs, params)
            cotangents = tuple(
                _scaled(g, d, w) for g, d in zip(piece.grads, piece.grad_dims, strict=True)
            )
            for name, value in pullback(_cotangents(cotangents, outs))[0].items():
                total[name] = total[name] + value if name in total else value
    return total


def _detached(plan: ReplayPlan) -> ReplayPlan:
    """The plan with every tensor detached from the step's graph.

    The replay runs with gradients enabled (some kernels, such as the CPU LSTM, keep what their
    backward needs only then); detached inputs keep it from extending the step's graph.
    """

    def detach(x: Any) -> Any:
        return x.detach() if isinstance(x, Tensor) else x

    pieces = [
        dataclasses.replace(
            piece,
            args=pytree.tree_map(detach, piece.args),
            kwargs=pytree.tree_map(detach, piece.kwargs),
            grads=tuple(g.detach() for g in piece.grads),
            masks=tuple(m.detach() for m in piece.masks),
        )
        for piece in plan.pieces
    ]
    return ReplayPlan(plan.size, pieces)


def _scaled(g: Tensor, dim: int, weights: Tensor) -> Tensor:
    """``g`` with each example's slice (along ``dim``) multiplied by its weight."""
    view = [1] * g.dim()
    view[dim] = -1
    return g * weights.to(g.dtype).view(view)


@contextlib.contextmanager
def _randomness_named(tap: Tap) -> Iterator[None]:
    """Name the layer when its replay draws random numbers that cannot be replayed."""
    try:
        yield
    except RuntimeError as error:
        if "randomness" not in str(error):
            raise
        raise RuntimeError(
            f"layer '{tap.name}' ({type(tap.module).__name__}) draws random numbers in its own "
            "forward (a functional dropout, drop path, noise): its per-example gradients need "
            "that forward run again with the same draws, which only nn.Dropout modules inside "
            "it provide. Use nn.Dropout modules there, or move its parameters into a child "
            "layer of their own"
        ) from None


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
        self._sizes: dict[int, int] = {}  # id(call) → its number of examples

    def _unit_sq_norms(self, calls: list[tuple[Tap, Call]], units: Units) -> Tensor:
        """Per-unit squared norms, layer by layer; shared parameters summed before squaring."""
        refuse_gradient_hooks(self.params)  # one added since make_engine: refused before summing
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

        self._sizes = {}
        for tap, call in calls:
            per_example = per_example_grads(tap, call, self.batch_dim(tap, call))
            self._sizes[id(call)] = next(iter(per_example.values())).shape[0]
            for local, grad in per_example.items():
                name = self._names[id(getattr(tap.module, local))]
                grad = grad.to(compute_dtype(grad.dtype))  # norms and sums in float32 at least
                summed = grad.sum(0)
                batch_sums[name] = batch_sums[name] + summed if name in batch_sums else summed
                if uses[name] > 1:
                    shared[name] = shared[name] + grad if name in shared else grad
                else:
                    add(sq_norm(_flat_rows(units.sum_rows(grad)), 1))
        for grad in shared.values():
            add(sq_norm(_flat_rows(units.sum_rows(grad)), 1))
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
                n = self._sizes[id(call)]
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
            self._calls, self._units, self._sizes = [], None, {}
        return out


def _flat_rows(grad: Tensor) -> Tensor:
    """(U, *shape) per-unit gradients as (U, F) rows (a 0-d parameter's are (U,): F = 1)."""
    return grad.reshape(grad.shape[0], -1)


def _in_half_precision(tap: Tap, call: Call) -> bool:
    """Whether the call ran in half precision (under autocast, or on half-precision weights)."""
    if call.autocast is not None and is_low(call.autocast):
        return True
    return any(is_low(meta[1]) for meta in call.out_meta) or any(
        is_low(getattr(tap.module, name).dtype) for name in tap.trainable
    )
