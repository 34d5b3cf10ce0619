"""Hugging Face heads' built-in losses, made a mean of per-example losses while an engine is on.

The engines clip each example's gradient of a loss that must be a mean (or sum) of per-example
losses. A Hugging Face head called with ``labels=`` computes its own loss, and the token-level
ones (causal LM, masked LM, token classification; sequence classification too, once a label is
ignored) average over every target token of the *batch*: with padding, each example's gradient
is scaled by the other examples' token counts, so one example added or removed moves every other
example's contribution and the clipped sum's sensitivity is no longer C. While an engine is
attached, a forward hook on each such head replaces its ``loss`` by
:func:`~dpfy.train.sequence_loss.per_example_token_mean` of the same logits and labels (guide
§5.4.1); a head whose loss dpfy does not know is refused when it returns one, before any
gradient exists. Nothing here imports ``transformers``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dpfy.train.sequence_loss import IGNORE_INDEX, per_example_token_mean

__all__ = ["HeadLoss", "LossGuard", "guard_hf_losses", "head_loss"]


@dataclass(frozen=True)
class HeadLoss:
    """How a known head's loss is recomputed per example from its logits and labels."""

    shift: bool  # causal LM: position t predicts the label at t + 1
    per_token: bool  # labels (B, T); else one label per example, (B,)


#: Head class-name endings → their loss; the first match wins (``…LMHeadModel`` is causal).
_HEADS: tuple[tuple[str, HeadLoss], ...] = (
    ("ForCausalLM", HeadLoss(shift=True, per_token=True)),
    ("LMHeadModel", HeadLoss(shift=True, per_token=True)),
    ("ForMaskedLM", HeadLoss(shift=False, per_token=True)),
    ("ForTokenClassification", HeadLoss(shift=False, per_token=True)),
    ("ForSequenceClassification", HeadLoss(shift=False, per_token=False)),
    ("ForImageClassification", HeadLoss(shift=False, per_token=False)),  # the same loss as above
)


def _is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel``, without importing transformers."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def head_loss(module: nn.Module) -> HeadLoss | None:
    """The per-example loss of a known Hugging Face head (None: not one dpfy knows)."""
    name = type(module).__name__
    return next((loss for ending, loss in _HEADS if name.endswith(ending)), None)


@dataclass
class LossGuard:
    """The hooks on a model's Hugging Face heads, and what the forwards they saw computed."""

    handles: list[RemovableHandle] = field(default_factory=list)
    token_heads: bool = False  # the model holds a token-level head (a sequence task)
    recomputed: int = 0  # forwards whose loss was replaced by the per-example token mean
    without_loss: int = 0  # head forwards that computed no loss (the caller's own, unseen)

    def remove(self) -> None:
        """Take the hooks off: the heads compute their own losses again."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @property
    def loss_normalisation(self) -> str | None:
        """'per-token-mean' when every token-level head forward seen had its loss replaced."""
        if self.token_heads and self.recomputed and not self.without_loss:
            return "per-token-mean"
        return None


def guard_hf_losses(model: nn.Module) -> LossGuard:
    """Hook every Hugging Face model in ``model`` (outermost and nested); ``remove()`` undoes it."""
    guard = LossGuard()
    for module in model.modules():
        if _is_hf_model(module):
            kind = head_loss(module)
            guard.token_heads |= kind is not None and kind.per_token
            hook = _hook_for(module, kind, guard)
            guard.handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return guard


def _hook_for(module: nn.Module, kind: HeadLoss | None, guard: LossGuard) -> Callable[..., Any]:
    signature = inspect.signature(module.forward)

    def hook(head: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if _loss_of(output) is None:
            guard.without_loss += kind is not None and kind.per_token
            return None
        given = signature.bind_partial(*args, **kwargs).arguments
        extra = given.get("kwargs", {})
        labels = given.get("labels")
        if extra.get("num_items_in_batch") is not None:
            raise ValueError(
                f"{type(head).__name__} was given num_items_in_batch, which divides the loss by "
                "the whole batch's token count and ties each example's gradient to the others; "
                "leave it out under DP-SGD"
            )
        if kind is None or labels is None:
            raise ValueError(
                f"{type(head).__name__} computed its own loss, and dpfy cannot check that it is "
                "a mean of per-example losses (a loss averaged over the batch's tokens or "
                "targets ties each example's gradient to the others). Call it without labels "
                "and compute the loss from its logits per example, e.g. with "
                "dpfy.train.sequence_loss.per_example_token_mean"
            )
        guard.recomputed += kind.per_token
        return _with_loss(output, _per_example_loss(head, kind, output, labels, extra))

    return hook


def _per_example_loss(
    head: nn.Module, kind: HeadLoss, output: Any, labels: Tensor, extra: dict[str, Any]
) -> Tensor | None:
    """The head's loss recomputed as a mean of per-example losses (None: HF's is already one)."""
    logits = output["logits"] if isinstance(output, dict) else output[1]
    ignore = extra.get("ignore_index", IGNORE_INDEX)
    if kind.per_token:
        shifted = extra.get("shift_labels")
        if shifted is not None:
            return per_example_token_mean(logits, shifted, ignore_index=ignore)
        return per_example_token_mean(logits, labels, shift=kind.shift, ignore_index=ignore)
    config = getattr(head, "config", None)
    if getattr(config, "problem_type", None) != "single_label_classification":
        return None  # regression / multi-label: a mean over B × outputs, the same per example
    return per_example_token_mean(logits[:, None, :], labels.view(-1, 1), ignore_index=ignore)


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, dict):
        return output.get("loss")
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return output[0] if output[0].dim() == 0 else None
    return None


def _with_loss(output: Any, loss: Tensor | None) -> Any:
    """``output`` with its loss replaced (a ModelOutput in place; a tuple rebuilt)."""
    if loss is None:
        return None
    if isinstance(output, dict):
        output["loss"] = loss
        return output
    return (loss, *output[1:])
