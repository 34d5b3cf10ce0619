"""Hooks that record, for each layer call, its inputs and the gradients of its outputs.

The captured tensors live in :class:`Call` objects held by the engine's :class:`Taps`, never on
``Parameter`` objects. A :class:`Call` is what a layer rule (or the vmap engine) reads. A layer
called on an input of batch size 1 in a larger batch (BERT's and GPT-2's position ids) has its
output expanded to the batch (:mod:`dpfy.train.grads.broadcast`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dpfy.data.provenance import BatchRefused
from dpfy.train.grads.broadcast import SharedInputs, expand_output, shares_batch
from dpfy.train.grads.dropout import MaskRecorder, has_dropout_inside
from dpfy.train.grads.inputs import call_size, input_batch_dim
from dpfy.train.grads.precision import autocast_dtype

__all__ = ["Call", "Tap", "Taps", "output_tensors", "release"]


@dataclasses.dataclass(slots=True)
class Call:
    """One forward call of one layer: positional inputs, output gradients, and clipping layout.

    ``inputs`` and ``grads`` are batch-first once the engine has prepared the call; ``group`` is
    the number of consecutive examples per clipping unit (1, or the microbatch size) and the
    batch size is then a multiple of it. ``grads[j]`` belongs to the j-th output that required
    grad (position ``out_index[j]`` among the output's tensors); it is None until backward
    reaches it (None after backward: the output was unused).
    """

    inputs: tuple[Any, ...]
    grads: list[Tensor | None]
    out_meta: list[tuple[torch.Size, torch.dtype, torch.device]]
    out_index: list[int]
    versions: tuple[int | None, ...]
    trainable: frozenset[str]
    group: int = 1
    #: Scratch space a rule may fill in ``sq_norms`` and read in ``clipped_sum`` of the same step
    #: (e.g. per-unit gradients it had to form anyway); dropped with the call.
    cache: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    #: Per-example gradients (B, F) by parameter name, when the engine reduced the call to them
    #: during backward (inputs and output gradients are then released); ``size`` is then B.
    #: Values are :class:`dpfy.train.grads.rows.Rows` (not imported here: rows imports layout,
    #: which imports this module).
    compact: dict[str, Any] | None = None
    size: int | None = None
    #: Whether the layer's parameters were switched off during this call (autograd then
    #: computed no ordinary gradient for them through this call).
    skipped: bool = False
    #: The number of the loader batch in hand when the call ran (None: none, or not followed).
    stamp: int | None = None
    #: The dtype autocast cast to on the output's device when the call ran (None: autocast off),
    #: so that the vmap engine replays the layer in the same precision.
    autocast: torch.dtype | None = None
    #: The call's keyword arguments (replayed with it by the vmap engine).
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The dropout masks drawn inside the layer during this call, in order (see
    #: :mod:`dpfy.train.grads.dropout`), so that its replay applies the same ones.
    masks: tuple[Tensor, ...] = ()

    @property
    def batch_size(self) -> int:
        """Number of examples in this call (first tensor input, batch-first)."""
        if self.size is not None:
            return self.size
        first = next(x for x in self.inputs if isinstance(x, Tensor))
        return first.shape[0]

    @property
    def num_units(self) -> int:
        """Number of clipping units: examples, or microbatches of ``group`` examples."""
        return self.batch_size // self.group

    def release(self) -> None:
        """Drop every tensor this call holds (autograd hooks may keep the object itself alive)."""
        self.inputs, self.versions, self.grads, self.out_meta, self.out_index = (), (), [], [], []
        self.cache, self.kwargs, self.masks = {}, {}, ()
        self.compact = None

    def stale_input(self) -> bool:
        """True when an input was modified in place after the layer read it."""
        return any(
            isinstance(x, Tensor) and v is not None and x._version != v
            for x, v in zip(self.inputs, self.versions, strict=True)
        )


@dataclasses.dataclass
class Tap:
    """A layer watched by the engine: its trainable parameter names and the calls seen so far."""

    name: str
    module: nn.Module
    trainable: frozenset[str]
    skip_param_grad: bool
    calls: list[Call] = dataclasses.field(default_factory=list)
    frozen: list[nn.Parameter] = dataclasses.field(default_factory=list)
    reroot: bool = False
    #: Whether a dropout lies inside the layer (its masks are then recorded per call).
    dropouts: bool = False
    recording: list[list[Tensor]] = dataclasses.field(default_factory=list)


def output_tensors(value: Any) -> Iterable[Tensor]:
    """The tensors of a module output (a tensor, or a tuple/list that holds some)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from output_tensors(item)


class Taps:
    """Registers and removes the capture hooks on a set of layers; holds their captured calls."""

    def __init__(
        self,
        taps: list[Tap],
        on_ready: Callable[[Tap, Call], None] | None = None,
        on_start: Callable[[], None] | None = None,
        *,
        batch_first: bool = True,
    ) -> None:
        self.taps = taps
        self.active = True
        # Batch-first models only: a call of batch size 1 among larger ones is then a broadcast.
        self.shared = SharedInputs() if batch_first else None
        self.on_ready = on_ready  # called in backward once a one-output call has its gradient
        self.on_start = on_start  # called at the first watched forward call after a clear()
        self.stamp: Callable[[], int | None] | None = None  # which loader batch is in hand
        self._fresh = True
        self._handles: list[RemovableHandle] = []
        self.batch_first = batch_first
        self.masks = MaskRecorder()
        self.masks.enabled = lambda: self.active

    def attach(self, root: nn.Module | None = None) -> None:
        """Register one forward pre-hook and one forward hook per watched layer.

        ``root`` (the whole model) gets a pre-hook too, so that a step starts when the model's
        forward does, before any code of its own runs ahead of the first watched layer.
        The forward hook goes first among the layer's forward hooks (``prepend``): it sees the
        output of the layer's own ``forward``, so a user's hook that rescales the output is part
        of the model downstream of the layer, and the gradient captured is that of the layer's
        own output (what its per-example gradients are formed from).
        """
        if root is not None:
            self._handles.append(root.register_forward_pre_hook(self._root, with_kwargs=True))
        for tap in self.taps:
            tap.dropouts = has_dropout_inside(tap.module)
            self._handles.append(tap.module.register_forward_pre_hook(partial(self._pre, tap)))
            self._handles.append(
                tap.module.register_forward_hook(
                    partial(self._post, tap), always_call=True, with_kwargs=True, prepend=True
                )
            )
        self.masks.attach([tap.module for tap in self.taps if tap.dropouts])

    def remove(self) -> None:
        """Remove every hook and give back any parameter still switched off by a pre-hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.masks.remove()
        for tap in self.taps:
            self._unfreeze(tap)
            release(tap)
            tap.recording.clear()

    def take(self) -> list[Tap]:
        """The taps that captured at least one call; the caller must clear them afterwards."""
        return [tap for tap in self.taps if tap.calls]

    def clear(self) -> None:
        """Drop every captured call (frees activations and output gradients)."""
        for tap in self.taps:
            release(tap)
        self._fresh = True
        if self.shared is not None:
            self.shared.reset()

    def _root(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model's forward begins: a step starts, and its inputs tell the batch size."""
        self._begin()
        if self.shared is not None and self.active:
            self.shared.begin(args, kwargs)

    def _pre(self, tap: Tap, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Stop autograd computing this layer's ordinary parameter gradient (wasted work).

        Safe when every floating input requires grad (outputs keep their graph through the
        inputs) or none does (the outputs are then given a fresh autograd root in ``_post``, so
        backward stops there after handing us their gradients). Mixed inputs are left alone.
        """
        if self._fresh:
            self._begin()
        if tap.dropouts and self.active and torch.is_grad_enabled():
            masks: list[Tensor] = []
            tap.recording.append(masks)
            self.masks.open.append(masks)
        if not (tap.skip_param_grad and self.active and torch.is_grad_enabled()):
            return
        if len(args) == 1 and isinstance(args[0], Tensor):  # one input: the common case
            x = args[0]
            needs = [x.requires_grad] if x.is_floating_point() else []
        else:
            needs = [
                x.requires_grad for x in args if isinstance(x, Tensor) and x.is_floating_point()
            ]
        if any(needs) and not all(needs):
            return  # some outputs could lose their graph; let autograd compute (we discard) it
        params = module._parameters  # where tap.trainable's names live (the module's own)
        for name in tap.trainable:
            param = params.get(name)
            if param is None:  # rebound outside the parameter dict since the engine was made
                param = getattr(module, name)
            if param.requires_grad:
                param.requires_grad_(False)
                tap.frozen.append(param)
        tap.reroot = bool(tap.frozen) and not any(needs)

    def _begin(self) -> None:
        """The first watched forward call since the last clear() starts a step."""
        if self._fresh and self.active and torch.is_grad_enabled():
            self._fresh = False
            if self.on_start is not None:
                self.on_start()

    def _post(
        self,
        tap: Tap,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        """Restore the parameters, keep the inputs, and hook the gradient of each output."""
        masks: tuple[Tensor, ...] = ()
        if tap.recording:
            recorded = tap.recording.pop()
            masks = tuple(recorded)
            self.masks.open = [m for m in self.masks.open if m is not recorded]
        reroot, tap.reroot = tap.reroot, False
        skipped = bool(tap.frozen)
        if skipped:
            self._unfreeze(tap)
        if not (self.active and torch.is_grad_enabled()):
            return None
        if reroot:
            output = _reroot(output)
        if isinstance(output, Tensor):  # one output tensor: the common case
            if not output.requires_grad:
                return None
            outputs, index = [output], [0]
        else:
            every = list(output_tensors(output))
            index = [j for j, t in enumerate(every) if t.requires_grad]
            if not index:
                return None
            outputs = [every[j] for j in index]
        batch = None if self.shared is None else self.shared.batch_for(tap.name, args, outputs)
        if batch is not None:  # an input every example shares: give the output the batch
            output = _map_tensors(output, partial(expand_output, batch=batch, layer=tap.name))
            outputs = [t for t in output_tensors(output) if t.requires_grad]
            args = tuple(shares_batch(x, batch) for x in args)
            reroot = True  # the output was replaced
        if len(args) == 1:
            x = args[0]
            versions: tuple[int | None, ...] = (x._version if isinstance(x, Tensor) else None,)
        else:
            versions = tuple(x._version if isinstance(x, Tensor) else None for x in args)
        call = Call(
            inputs=tuple(args),
            grads=[None] * len(outputs),
            out_meta=[(t.shape, t.dtype, t.device) for t in outputs],
            out_index=index,
            versions=versions,
            trainable=tap.trainable,
            skipped=skipped,
            stamp=None if self.stamp is None else self.stamp(),
            autocast=autocast_dtype(outputs[0].device.type),
            kwargs=dict(kwargs) if kwargs else {},
            masks=masks,
        )
        if not (args and isinstance(args[0], Tensor)) or input_batch_dim(module) is not None:
            call.size = call_size(module, tuple(args), kwargs, batch_first=self.batch_first)
        tap.calls.append(call)
        for j, out in enumerate(outputs):
            out.register_hook(partial(self._store_grad, tap, call, j))
        return output if reroot else None

    def _store_grad(self, tap: Tap, call: Call, index: int, grad: Tensor) -> None:
        """Tensor hook: keep the gradient of one output; hand a complete call to ``on_ready``."""
        grads = call.grads
        if index >= len(grads):  # the call was released before its backward pass reached it
            raise BatchRefused(
                "this backward pass reaches a layer call whose captured inputs were already "
                "dropped (by optimizer.accumulate() or zero_grad() run between its forward and "
                "this backward), so its examples cannot be clipped. Run each piece's forward "
                "and backward together — forward, backward, accumulate() — and evaluate under "
                "torch.no_grad(). Nothing was applied: call optimizer.zero_grad() and go on "
                "with the next loader batch"
            )
        previous = grads[index]
        grads[index] = grad if previous is None else previous + grad
        if self.on_ready is not None and len(grads) == 1:
            self.on_ready(tap, call)

    @staticmethod
    def _unfreeze(tap: Tap) -> None:
        """Switch ``requires_grad`` back on for the parameters a pre-hook switched off."""
        for param in tap.frozen:
            param.requires_grad_(True)
        tap.frozen.clear()


class _Reroot(torch.autograd.Function):
    """Identity that gives a graph-less tensor a fresh autograd root (backward: nothing).

    The output is a non-leaf, not a view, so user code may still modify it in place (e.g. a
    following ``ReLU(inplace=True)``); backward stops here after the hooks saw the gradient.
    """

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, x: Tensor) -> Tensor:
        """Return ``x``'s data under a new autograd node."""
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        """Nothing upstream needs a gradient."""
        return None, None


_ANCHOR = torch.empty(0, requires_grad=True)  # the input that makes _Reroot outputs need grad


def _map_tensors(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """A module output with ``fn`` applied to each tensor in it (tuples and lists rebuilt)."""
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, (tuple, list)):
        items = [_map_tensors(item, fn) for item in output]
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    return output


def _reroot(output: Any) -> Any:
    """Floating output tensors re-rooted by ``_Reroot`` (same values and storage)."""
    return _map_tensors(output, lambda t: _Reroot.apply(_ANCHOR, t) if t.is_floating_point() else t)


def release(tap: Tap) -> None:
    """Release and forget every call a tap captured."""
    for call in tap.calls:
        call.release()
    tap.calls.clear()
