"""Gradient hooks on parameters: refused, because per-example clipping never runs them.

A hook on a parameter (``p.register_hook(lambda g: 2 * g)``) changes that parameter's gradient in
an ordinary backward pass, so a per-example loop would clip the changed gradients. The engines
form each example's gradient from the layers' inputs and output gradients, without the
parameter's own gradient, so the hook would be skipped silently (the clipped sum then differs from
what the model's code says); a hook after accumulation
(``register_post_accumulate_grad_hook``) would act on the unclipped, un-noised gradient. Either is
refused, naming the parameter. Hooks that torch itself registers (data parallel) are not the
user's and are left alone. Forward hooks on layers are exact (:mod:`dpfy.train.grads.capture`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = ["gradient_hook_blocker", "refuse_gradient_hooks"]


def _owner_module(hook: Callable[..., Any]) -> str:
    """The module that defines ``hook`` (its function, for a partial or a bound method)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)
    return getattr(hook, "__module__", "") or ""


def _user_hooks(param: nn.Parameter) -> list[Callable[..., Any]]:
    """The gradient hooks on ``param`` that are not torch's own."""
    found = []
    for hooks in (param._backward_hooks, getattr(param, "_post_accumulate_grad_hooks", None)):
        if hooks:
            found += [h for h in hooks.values() if not _owner_module(h).startswith("torch.")]
    return found


def gradient_hook_blocker(params: Mapping[str, nn.Parameter]) -> str | None:
    """Why no engine can clip these parameters exactly (a user's gradient hook), else None."""
    for name, param in params.items():
        if _user_hooks(param):
            return (
                f"parameter '{name}' has a gradient hook (Tensor.register_hook or "
                "register_post_accumulate_grad_hook): per-example clipping forms each example's "
                "gradient without running it, so its change would be lost (or it would see the "
                "unclipped, un-noised gradient). Remove the hook; to rescale a gradient, scale "
                "the parameter's use in the forward pass (or the layer's output, with a forward "
                "hook) instead"
            )
    return None


def refuse_gradient_hooks(params: Mapping[str, nn.Parameter]) -> None:
    """Raise ``ValueError`` when a parameter carries a user's gradient hook."""
    reason = gradient_hook_blocker(params)
    if reason is not None:
        raise ValueError(reason)
