"""The engine interface shared by the fast and vmap engines: clip, accumulate, hand over.

An engine watches a model through hooks. After the user's ordinary ``loss.backward()``,
:meth:`GradEngine.clip_and_accumulate` turns what the hooks captured into per-unit gradient norms
(a unit is one example, or one microbatch), clips each unit to ``max_grad_norm`` and adds the
clipped sum into an accumulator, so several physical batches can form one logical batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from dpfy._validate import check_count, check_positive
from dpfy.data.padding import Padding
from dpfy.train.grads.capture import Call, Tap, Taps
from dpfy.train.grads.hf_losses import LossGuard
from dpfy.train.grads.layout import Units
from dpfy.train.grads.precision import autocast_off, compute_dtype
from dpfy.train.grads.registry import find_rule
from dpfy.train.grads.substitutions import Substitution, restore

__all__ = ["ClipResult", "GradEngine", "LossReduction", "NoiseStart"]

LossReduction = Literal["mean", "sum"]

#: Layers watched by an attached engine (two engines on one model would corrupt each other).
WATCHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class ClipResult:
    """What one ``clip_and_accumulate`` did: unclipped unit norms and how many examples it saw.

    ``norms`` holds one entry per clipping unit (per example, or per microbatch), computed
    before clipping, detached; ``num_units`` is its length.
    """

    norms: Tensor
    num_examples: int
    num_units: int


class NoiseStart(Protocol):
    """How the parameters' sums start from their noise on the last physical batch of a step.

    The engine opens each named parameter's running sum just before its layer is summed, as a
    tensor ``fill`` writes the noise into, and rules add their products into it in place (one
    parameter-sized buffer per parameter, and the noise drawn when it is needed, not held
    through the forward and backward passes). A sum that already existed (earlier physical
    batches) gets its noise from ``add`` once it is complete. Each name gets exactly one.
    """

    names: frozenset[str]

    def fill(self, name: str, out: Tensor) -> None:
        """Overwrite ``out``, the sum of parameter ``name`` about to be opened, with noise."""
        ...

    def add(self, name: str, total: Tensor) -> None:
        """Add noise into the finished sum of parameter ``name``."""
        ...


class GradEngine:
    """Base of both engines: hooks, accumulator, loss scaling, clipping, hand-over, detach."""

    kind: str = ""

    def __init__(
        self,
        model: nn.Module,
        taps: list[Tap],
        *,
        batch_first: bool,
        substitutions: list[Substitution],
        param_names: dict[int, str],
        fallback_reason: str | None = None,
        loss_guard: LossGuard | None = None,
    ) -> None:
        self.model = model
        self.loss_guard = loss_guard or LossGuard()  # Hugging Face heads' losses, per example
        self.batch_first = batch_first
        self.fallback_reason = fallback_reason
        self._substitutions = substitutions
        self._names = param_names  # id(param) → name in the original model
        self.params: dict[str, nn.Parameter] = {}
        for tap in taps:
            for local in sorted(tap.trainable):
                param = getattr(tap.module, local)
                self.params[param_names[id(param)]] = param
        self._acc: dict[str, Tensor] = {}  # running sums, in float32 at least (see precision)
        self._sum_dtypes = {name: compute_dtype(p.dtype) for name, p in self.params.items()}
        self._devices = tuple({p.device.type for p in self.params.values()})
        self._summing = False  # a logical batch's sum is open (begun, or added to)
        self._noised: set[str] = set()  # NoiseStart names already given their noise this call
        self.num_examples = 0  # examples accumulated since the last reset
        self._grads_before: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        self._state_before: list[tuple[int, int]] = []
        self._modules = list(model.modules())  # whose parameters and buffers no forward may write
        # The modules' own parameter and buffer dicts, read at every step. nn.Module makes each
        # once, in __init__; registering, assigning, deleting or loading a parameter or buffer,
        # and .to()/_apply, change their entries, never the dicts, so these are the live dicts:
        # an entry written, rebound, added or removed is seen exactly as through the modules.
        self._state_dicts = [
            tensors for module in self._modules for tensors in (module._parameters, module._buffers)
        ]
        self._weight_only = power_iteration_buffers(model)
        self._taps = Taps(
            taps, on_ready=self._on_ready, on_start=self._note_grads, batch_first=batch_first
        )
        for tap in taps:
            if tap.module in WATCHED:
                raise ValueError(
                    f"layer '{tap.name}' is already watched by another engine; detach() it first"
                )
        self._taps.attach(model)
        WATCHED.update(tap.module for tap in taps)
        self._attached = True

    # ---------------------------------------------------------------- public API

    def follow(self, batches: Callable[[], int | None]) -> None:
        """Stamp every captured call with ``batches()``: the number of the loader batch in hand."""
        self._taps.stamp = batches

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Capture nothing inside the block: forward passes there are not part of any step."""
        active, self._taps.active = self._taps.active, False
        try:
            yield
        finally:
            self._taps.active = active

    def batch_stamps(self) -> set[int | None]:
        """The stamps of the calls whose outputs got gradients since the last clip."""
        return {call.stamp for tap in self._taps.take() for call in tap.calls if _got_grad(call)}

    def clip_and_accumulate(
        self,
        max_grad_norm: float,
        loss_reduction: LossReduction = "mean",
        *,
        microbatch_size: int | None = None,
        groups: Tensor | None = None,
        noise: NoiseStart | None = None,
        scale: float = 1.0,
        padding: Padding | None = None,
    ) -> ClipResult:
        """Clip each unit's gradient to ``max_grad_norm`` and add the clipped sum to the total.

        Call once after each ``loss.backward()``. ``loss_reduction`` says how the loss combined
        the examples: ``"mean"`` (loss = (1/n) Σ ℓᵢ) or ``"sum"``. With ``microbatch_size=k``,
        groups of k consecutive examples are averaged and the *average* is clipped; a last,
        smaller group is averaged over its own size. Consecutive groups shift when one example
        is added, so they carry no sensitivity bound: the private optimizer passes each
        example's independently drawn microbatch as ``groups`` instead (guide alg. 3, 2C).
        With ``groups`` (an integer tensor, one id per example, any order and sizes) each
        group's *average* gradient is clipped instead — e.g. one group per user for user-level
        DP-SGD (McMahan et al. 2018), where the whole group is the unit of privacy and the
        sensitivity stays C. Afterwards every trainable ``p.grad`` is None: the
        non-private gradient of the backward pass is discarded so it cannot be used by accident.
        An empty batch (or no backward since the last call) adds nothing and reports 0 examples.
        ``noise`` (last physical batch of a logical batch only) starts the named parameters'
        sums from noise filled in meanwhile (see :class:`NoiseStart`). ``scale`` multiplies each
        clipped unit gradient before it is summed (the private optimizer passes 1/B, so the sum
        is the average without a pass over the parameters); the reported norms are unscaled.
        ``padding`` (a static-shape batch, :mod:`dpfy.data.padding`) marks its last rows as
        padding: they get a clip factor of exactly 0 and are neither counted nor reported.
        """
        self._require_attached()
        clip = check_positive("max_grad_norm", max_grad_norm)
        check_positive("scale", scale)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        group = 1 if microbatch_size is None else check_count("microbatch_size", microbatch_size)
        if group < 1:
            raise ValueError(f"microbatch_size must be a whole number >= 1, got {group!r}")
        if groups is not None:
            groups = _check_groups(groups, microbatch_size)
        if padding is not None and (groups is not None or group != 1):
            raise ValueError("padded batches are clipped per example: pass no groups with them")
        self._taps.active = False  # engines may call watched layers themselves
        try:
            # The norms and sums are data, not part of any graph: under autograd every layer's
            # captured tensors would stay alive in their history until the step ended. They are
            # computed in float32 at least, whatever autocast the caller is in.
            with torch.no_grad(), autocast_off(*self._devices):
                self._noised = set()
                result = self._clip_batch(
                    clip, loss_reduction, group, groups, noise, scale, padding
                )
                if noise is not None:
                    self._finish_noise(noise)
                return result
        finally:
            self._release()

    def _clip_batch(
        self,
        clip: float,
        loss_reduction: LossReduction,
        group: int,
        groups: Tensor | None,
        noise: NoiseStart | None,
        sum_scale: float,
        padding: Padding | None = None,
    ) -> ClipResult:
        """Clip the captured batch's units and add their clipped sum (× ``sum_scale``)."""
        calls = self._collect_calls()
        n = self._batch_size(calls)
        if padding is not None:
            padding.check_rows(n)
        if groups is not None and groups.numel() != n:
            raise ValueError(
                f"groups has {groups.numel()} ids but the batch has {n} examples; pass one "
                "group id per example of this batch"
            )
        if n == 0:
            return ClipResult(torch.zeros(0), 0, 0)
        units = Units.consecutive(n, group) if groups is None else Units.from_ids(groups)
        base = float(n) if loss_reduction == "mean" else 1.0
        sq = self._unit_sq_norms(calls, units)
        calls.clear()  # the engine keeps what it needs; let summed layers free their tensors
        scale = _unit_scale(base, units, sq)  # unit gradient = scale · (sum of captured grads)
        norms = sq.clamp_min(0).sqrt_()  # in place on the fresh clamp, never on sq itself
        if not isinstance(scale, float) or scale != 1.0:
            norms.mul_(scale)
        # min(1, C/‖g‖), as C / norms computes it (1/‖g‖ · C); a zero norm: C/0 = ∞ → 1
        factors = torch.reciprocal(norms).mul_(clip).clamp_max_(1.0)
        real, count = n, units.count
        if padding is not None and padding.padded:  # padding rows: weight exactly 0, unseen
            real = count = padding.real
            padding.check_finite(norms[real:])
            factors[real:] = 0.0
            norms = norms[:real]
        self._accumulate(factors.mul_(scale * sum_scale), noise)
        self.num_examples += real
        # Formed under no_grad, so nothing to detach from (detach() would be one more call).
        return ClipResult(norms.detach() if norms.requires_grad else norms, real, count)

    @property
    def capturing(self) -> bool:
        """Whether forward passes are captured now (not while clipping replays layers; paused)."""
        return self._taps.active

    @property
    def summing(self) -> bool:
        """Whether a logical batch's sum is open (begun, or something was accumulated)."""
        return self._summing

    def summed_grads(self) -> dict[str, Tensor]:
        """The accumulated clipped sum for every trainable parameter (zeros where none came).

        In the parameter's dtype: a half-precision parameter's sum, kept in float32, is cast
        once it is complete (noise included, when the sum was opened from it).
        """
        out = {}
        for name, param in self.params.items():
            total = self._acc.get(name)
            if total is None:
                out[name] = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
            else:
                out[name] = total if total.dtype == param.dtype else total.to(param.dtype)
        return out

    def write_grads(self) -> None:
        """Put the accumulated clipped sum into each trainable ``p.grad`` (zeros where none)."""
        for name, value in self.summed_grads().items():
            self.params[name].grad = value.clone()

    def reset(self) -> None:
        """Forget the accumulated clipped sum and example count (start a new logical batch)."""
        self._acc.clear()
        self._summing = False
        self.num_examples = 0

    def discard_captures(self) -> None:
        """Drop what the hooks captured since the last clip, and the plain gradients with it."""
        self._release()

    def detach(self) -> None:
        """Remove every hook and substitution: the model is exactly as before ``make_engine``."""
        if not self._attached:
            return
        self._taps.remove()
        self.loss_guard.remove()
        for tap in self._taps.taps:
            WATCHED.discard(tap.module)
        restore(self._substitutions)
        self._substitutions = []
        self._attached = False

    # ---------------------------------------------------------------- engine-specific parts

    def _unit_sq_norms(self, calls: list[tuple[Tap, Call]], units: Units) -> Tensor:
        """Squared gradient norm of each clipping unit, before loss scaling."""
        raise NotImplementedError

    def _unit_weighted_sums(self, weights: Tensor) -> dict[str, Tensor]:
        """Σ_u weights[u]·grad_u by parameter name, for the calls of the last norms."""
        raise NotImplementedError

    def _accumulate(self, weights: Tensor, noise: NoiseStart | None) -> None:
        """Add Σ_u weights[u]·grad_u into the running sums (engines may add in place)."""
        for name, value in self._unit_weighted_sums(weights).items():
            self._add_into(name, self._slot(name, noise), value)

    def _slot(self, name: str, noise: NoiseStart | None) -> Tensor | None:
        """The running sum of ``name`` to add into; opened from noise where ``noise`` says so.

        None: no sum yet and no noise to start from — the first sum becomes the running sum.
        """
        if name in self._acc:
            return self._acc[name]
        if noise is None or name not in noise.names or name in self._noised:
            return None
        self._noised.add(name)
        total = torch.empty(  # the global shape, plain, also for an FSDP2 (DTensor) parameter
            self.params[name].shape,
            dtype=self._sum_dtypes[name],
            device=self.params[name].device,
        )
        noise.fill(name, total)
        self._acc[name] = total
        self._summing = True
        return total

    def _add_into(self, name: str, slot: Tensor | None, value: Tensor) -> None:
        """Add one parameter's sum into its running sum (or start the sum with it)."""
        if slot is None:
            self._add(name, value)
            return
        if value.shape != slot.shape or value.dtype != slot.dtype:  # (two calls fewer if not)
            value = value.reshape(slot.shape).to(slot.dtype)
        slot.add_(value)

    def _finish_noise(self, noise: NoiseStart) -> None:
        """Give every named parameter its noise: sums formed before get it added, others filled."""
        if noise.names <= self._noised:  # every sum was opened from its noise (the fast engine)
            return
        # One stream order however the names are reached: largest first, as the engines open them.
        for name in self._largest_first(noise.names):
            if name in self._noised:
                continue
            if name in self._acc:
                noise.add(name, self._acc[name])
                self._noised.add(name)
            else:  # no gradient reached it: the sum is its noise alone
                self._slot(name, noise)

    def _largest_first(self, names: Iterable[str]) -> list[str]:
        """Parameter names, largest first (ties by name): the order sums are opened from noise."""
        return sorted(names, key=lambda name: (-self.params[name].numel(), name))

    def _check_calls(self, tap: Tap, calls: list[Call]) -> None:
        """Engine-specific refusals (the fast engine refuses repeated calls)."""

    def _on_ready(self, tap: Tap, call: Call) -> None:
        """Called during backward when a one-output call has its gradient (default: nothing)."""

    # ---------------------------------------------------------------- helpers

    def _collect_calls(self) -> list[tuple[Tap, Call]]:
        """Calls whose outputs got gradients, checked; also catches parameters used unseen."""
        self._check_no_writes()
        seen: list[tuple[Tap, Call]] = []
        for tap in self._taps.take():
            live = [c for c in tap.calls if _got_grad(c)]
            self._check_calls(tap, live)
            for call in live:
                if call.stale_input():
                    raise RuntimeError(
                        f"an input of layer '{tap.name}' was modified in place after the layer "
                        "used it; its per-example gradients cannot be computed"
                    )
                seen.append((tap, call))
        # A parameter's ordinary gradient is explained by a watched call that let autograd
        # compute it; any other non-zero gradient came from a use the hooks never saw.
        changed = [
            (name, param)
            for name, param in self.params.items()
            if param.grad is not None and self._grad_changed(param)
        ]
        if not changed:  # the fast engine's usual step: no parameter got an ordinary gradient
            return seen
        explained = {
            id(getattr(t.module, p)) for t, c in seen if not c.skipped for p in t.trainable
        }
        for name, param in changed:
            if id(param) in explained:
                continue
            if bool(param.grad.detach().ne(0).any()):  # zero_grad(set_to_none=False) is fine
                raise RuntimeError(
                    f"parameter '{name}' received a gradient outside any watched layer call "
                    "(used directly by another module?); its per-example gradient is unknown"
                )
        return seen

    def batch_dim(self, tap: Tap, call: Call) -> int:
        """Where the batch sits in this call's tensors.

        Batch-first models: dim 0. Sequence-first models (``batch_first=False``): dim 1 for
        sequence-carrying tensors — floats (T, B, ..., d) of 3+ dims and integer indices (T, B,
        ...) of 2+ dims — and dim 0 otherwise (pooled (B, d) features, channels-first layers).
        """
        x = call.inputs[0] if call.inputs else None  # a call of keyword arguments only
        if self.batch_first or not isinstance(x, Tensor):
            return 0
        rule = find_rule(tap.module)
        if rule is not None and rule.channels_first:
            return 0
        sequence_ndim = 3 if x.is_floating_point() or x.is_complex() else 2
        return 1 if x.dim() >= sequence_ndim else 0

    def _note_grads(self) -> None:
        """At the first watched forward call of a step: remember every ``p.grad`` as it is.

        Also the version counter of every parameter and buffer of the model, so that a write
        from the forward pass into the model's own state is seen (:meth:`_check_no_writes`).
        """
        self._state_before = self._state_versions()
        self._grads_before = {  # weak: a noted gradient must not outlive its parameter's use
            id(p): (weakref.ref(p.grad), p.grad._version)
            for p in self.params.values()
            if p.grad is not None
        }

    def _state_versions(self) -> list[tuple[int, int]]:
        """(identity, version) of every parameter and buffer of the model, frozen ones included.

        Read from the modules' own dicts (``_state_dicts``, the live dict objects; see
        ``__init__`` for why that list cannot go stale): a write in place bumps the version, a
        rebinding (``self.buffer = f(x)``) changes the identity.
        """
        skip = self._weight_only
        return [
            (id(tensor), tensor._version)
            for tensors in self._state_dicts
            for tensor in tensors.values()
            if tensor is not None and (not skip or id(tensor) not in skip)
        ]

    def _check_no_writes(self) -> None:
        """Refuse a forward pass that wrote into the model's parameters or buffers.

        Such a write (``nn.Embedding(max_norm=…)`` renormalising the rows looked up, running
        statistics) depends on the private batch and reaches the released model without
        clipping or noise.
        """
        if not self._state_before or self._state_versions() == self._state_before:
            return
        before = dict(self._state_before)
        named = [*self.model.named_parameters(), *self.model.named_buffers()]
        changed = [name for name, t in named if before.get(id(t)) != t._version] or ["a buffer"]
        raise RuntimeError(
            f"the forward pass modified '{changed[0]}' in place (a layer writing to its own "
            "parameters or buffers from the data, such as nn.Embedding(max_norm=...) or running "
            "statistics): that change reaches the model without clipping or noise. The step was "
            "refused, but the forward pass already changed the model: reload the last checkpoint "
            "and remove the write from the layer"
        )

    def _grad_changed(self, param: nn.Parameter) -> bool:
        """Whether autograd wrote ``param.grad`` since the step's first watched forward call."""
        if param.grad is None:
            return False
        if id(param) not in self._grads_before:
            return True
        before, version = self._grads_before[id(param)]
        return param.grad is not before() or param.grad._version != version

    def _batch_size(self, calls: list[tuple[Tap, Call]]) -> int:
        """The batch size every captured call agrees on (0 when nothing was captured)."""
        sizes: set[tuple[str, int]] = set()
        for tap, call in calls:
            if call.size is not None:
                sizes.add((tap.name, call.size))
            elif isinstance(x := call.inputs[0], Tensor):
                sizes.add((tap.name, x.shape[self.batch_dim(tap, call)]))
        values = {s for _, s in sizes}
        if len(values) > 1:
            raise ValueError(
                f"watched layers saw different batch sizes {sorted(sizes)}; is batch_first set "
                "right for this model? (A layer called on an input of batch size 1 that every "
                "example shares is handled in batch-first models when the model's first input "
                "or an earlier layer shows the batch size; otherwise pass that input with its "
                "batch dim, e.g. position_ids.expand(batch_size, -1))"
            )
        return values.pop() if values else 0

    def _add(self, name: str, value: Tensor) -> None:
        """Add one parameter's clipped sum into the accumulator (in place once it exists)."""
        param, dtype = self.params[name], self._sum_dtypes[name]
        if value.shape != param.shape or value.dtype != dtype:  # (two calls fewer if not)
            value = value.reshape(param.shape).to(dtype)
        if name in self._acc:
            self._acc[name].add_(value)
        else:  # the first sum becomes the accumulator: rules return freshly computed tensors
            self._acc[name] = value.detach()
        self._summing = True

    def _release(self) -> None:
        """Drop captured tensors and the non-private gradients of the backward pass."""
        self._taps.active = True
        self._taps.clear()
        self._grads_before, self._state_before = {}, []
        for param in self.params.values():
            param.grad = None

    def _require_attached(self) -> None:
        """Refuse to work after detach()."""
        if not self._attached:
            raise RuntimeError("this engine was detached; create a new one with make_engine")

    def __repr__(self) -> str:
        """Engine kind and what it watches."""
        extra = f", fallback_reason={self.fallback_reason!r}" if self.fallback_reason else ""
        return f"{type(self).__name__}(kind={self.kind!r}, params={len(self.params)}{extra})"


def _got_grad(call: Call) -> bool:
    """Whether backward reached the call: a gradient for one of its outputs, or compact rows."""
    return call.compact is not None or any(grad is not None for grad in call.grads)


def power_iteration_buffers(model: nn.Module) -> set[int]:
    """Buffers a forward pass may update because they follow the weights, not the data.

    Spectral normalisation's power-iteration vectors (``u``, ``v``) are refined from the weight
    matrix alone at each training forward pass; both torch APIs keep them as buffers.
    """
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    found: set[int] = set()
    for module in model.modules():
        if isinstance(module, _SpectralNorm):
            found.update((id(module._u), id(module._v)))
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, SpectralNorm):
                found.update(id(getattr(module, hook.name + suffix)) for suffix in ("_u", "_v"))
    return found


def _unit_scale(base: float, units: Units, like: Tensor) -> Tensor | float:
    """``base`` over each unit's size (``like``'s dtype and device); a number for single examples.

    Units of one example each (``width`` 1: no unit holds more) need no tensor, so no
    host-to-device copy per step on a GPU.
    """
    if units.width == 1:
        return base
    sizes = units.sizes.to(torch.float64)  # exact ratios, then the gradients' dtype
    return (base / sizes).to(like.device, like.dtype)


def _check_groups(groups: Tensor, microbatch_size: int | None) -> Tensor:
    """A 1-D integer tensor of group ids, and no microbatch size beside it."""
    if microbatch_size is not None:
        raise ValueError("pass microbatch_size or groups, not both")
    if (
        not isinstance(groups, Tensor)
        or groups.dim() != 1
        or groups.dtype.is_floating_point
        or groups.dtype.is_complex
        or groups.dtype == torch.bool
    ):
        raise ValueError("groups must be a 1-D integer tensor holding one group id per example")
    return groups
