"""Dropout masks drawn inside a watched layer, recorded so its replay draws the very same ones.

The vmap engine forms a layer's per-example gradients by running the layer's forward again, on
each example alone. A layer that owns parameters and also has children (the Vision Transformer's
embeddings: ``x + self.pos_embed`` then ``self.dropout``) runs those children again too, and a
dropout there would draw a new mask: the gradients would belong to another forward pass (and
``vmap`` refuses random draws). So, while the model runs forward for a step, each ``nn.Dropout``
(and ``Dropout1d/2d/3d``) inside such a layer draws its mask as ``dropout(ones)`` — the same
distribution as the module's own draw, since these dropouts multiply their input by a random
mask — and applies it as ``x · mask``; the replay applies the recorded mask instead of drawing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["DROPOUTS", "MaskRecorder", "has_dropout_inside", "replaying"]

#: Dropouts whose output is ``input · dropout(ones)``, with the function that draws the mask.
DROPOUTS: dict[type[nn.Module], Callable[..., Tensor]] = {
    nn.Dropout: F.dropout,
    nn.Dropout1d: F.dropout1d,
    nn.Dropout2d: F.dropout2d,
    nn.Dropout3d: F.dropout3d,
}


@dataclasses.dataclass
class _Cursor:
    """The recorded masks of one call being replayed, and how many were used."""

    masks: tuple[Tensor, ...]
    used: int = 0


_REPLAY: list[_Cursor] = []


@contextlib.contextmanager
def replaying(masks: tuple[Tensor, ...]) -> Iterator[None]:
    """Inside the block, dropouts inside watched layers apply ``masks`` in order, drawing none."""
    cursor = _Cursor(tuple(masks))
    _REPLAY.append(cursor)
    try:
        yield
    finally:
        _REPLAY.pop()
    if cursor.used != len(cursor.masks):
        raise RuntimeError(
            f"replaying a layer applied {cursor.used} dropout masks where its forward pass drew "
            f"{len(cursor.masks)}: the layer's forward depends on more than its inputs, so its "
            "per-example gradients cannot be formed"
        )


def has_dropout_inside(module: nn.Module) -> bool:
    """Whether a dropout (of :data:`DROPOUTS`) lies strictly inside ``module``."""
    return any(type(m) in DROPOUTS for m in module.modules() if m is not module)


class MaskRecorder:
    """Hooks on the dropouts inside watched layers; records masks into the calls in progress."""

    def __init__(self) -> None:
        self.open: list[list[Tensor]] = []  # one list per watched call whose forward is running
        self.enabled: Callable[[], bool] = lambda: True
        self._switched: set[int] = set()
        self._handles: list[RemovableHandle] = []

    def attach(self, owners: list[nn.Module]) -> None:
        """Hook each dropout inside the given layers (once each)."""
        seen: set[int] = set()
        for owner in owners:
            for module in owner.modules():
                if module is owner or type(module) not in DROPOUTS or id(module) in seen:
                    continue
                seen.add(id(module))
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post, always_call=True))

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.open.clear()

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Switch the dropout's own draw off when its mask is to be recorded or replayed."""
        if not module.training or getattr(module, "p", 0.0) == 0.0:
            return
        recording = bool(self.open) and self.enabled() and torch.is_grad_enabled()
        if _REPLAY or recording:
            module.training = False  # the module's forward is then the identity
            self._switched.add(id(module))

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Apply the recorded (replay) or a freshly drawn (recorded) mask to the input."""
        if id(module) not in self._switched:
            return None
        self._switched.discard(id(module))
        module.training = True
        x = args[0]
        if _REPLAY:
            cursor = _REPLAY[-1]
            if cursor.used >= len(cursor.masks):
                cursor.used += 1
                raise RuntimeError(
                    "replaying a layer drew more dropout masks than its forward pass did: the "
                    "layer's forward depends on more than its inputs"
                )
            mask = cursor.masks[cursor.used]
            cursor.used += 1
        else:
            p = module.p  # type: ignore[attr-defined]
            mask = DROPOUTS[type(module)](torch.ones_like(x), p, True)
            for masks in self.open:
                masks.append(mask)
        return x.mul_(mask) if getattr(module, "inplace", False) else x * mask
