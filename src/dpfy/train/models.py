"""Small reference models for private training, all runnable on dpfy's fast gradient engine.

``build_model(name, input_shape, num_classes, **options)`` looks the name up in a registry
(``@register_model``). Every model is made only of layers with fast per-example rules (Linear,
Conv2d, GroupNorm) plus parameter-free activations, pooling and flattening — no BatchNorm, which
couples the examples of a batch and breaks per-example clipping (guide §5.5.1).

Activations default to ``tanh``: bounded ("tempered sigmoid") activations keep gradient norms
small and train better under DP-SGD than ReLU (Papernot et al., 2021, "Tempered Sigmoid
Activations for Deep Learning with Differential Privacy").
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelSpec",
    "available_models",
    "build_model",
    "register_model",
]

Builder = Callable[..., nn.Module]

_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: its name, a one-line description and its builder."""

    name: str
    description: str
    build: Builder


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(name: str, description: str) -> Callable[[Builder], Builder]:
    """Register ``builder(input_shape, num_classes, **options)`` under ``name``."""

    def decorate(build: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = ModelSpec(name=name, description=description, build=build)
        return build

    return decorate


def available_models() -> dict[str, str]:
    """Registered model names with their one-line descriptions."""
    return {name: spec.description for name, spec in sorted(_REGISTRY.items())}


def _options_of(build: Builder) -> list[str]:
    """The keyword options a builder accepts (for error messages)."""
    params = inspect.signature(build).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, **options: Any
) -> nn.Module:
    """Build the registered model ``name`` for inputs of ``input_shape`` (no batch dim).

    ``options`` go to the model's builder (e.g. ``hidden_sizes`` and ``activation`` for ``mlp``);
    an option the model does not take is a ValueError listing the ones it does.
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"input_shape must be non-empty with positive sizes, got {input_shape}")
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"num_classes must be a whole number >= 2, got {num_classes!r}")
    accepted = _options_of(spec.build)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"model {name!r} takes no option(s) {unknown}; it takes {accepted}")
    return spec.build(shape, int(num_classes), **options)


def _activation(name: str) -> nn.Module:
    """A fresh activation module by name (``tanh`` or ``relu``)."""
    make = _ACTIVATIONS.get(name)
    if make is None:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return make()


@register_model("logreg", "multinomial logistic regression: flatten + one linear layer")
def _logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Flatten, then one Linear layer producing the class logits."""
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            linear=nn.Linear(math.prod(input_shape), num_classes),
        )
    )


@register_model("mlp", "flatten + fully connected hidden layers (default 1×128, tanh)")
def _mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    hidden_sizes: Sequence[int] = (128,),
    activation: str = "tanh",
) -> nn.Module:
    """Flatten, hidden Linear + activation blocks, then a Linear output layer.

    One hidden layer of 128 units by default: few parameters (less noise in total under DP-SGD)
    yet enough for digits (≈ 10k parameters) and Fashion-MNIST (≈ 100k).
    """
    sizes = [math.prod(input_shape), *(int(h) for h in hidden_sizes)]
    if any(h < 1 for h in sizes[1:]):
        raise ValueError(f"hidden_sizes must be positive, got {tuple(hidden_sizes)}")
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers[f"hidden{i}"] = nn.Linear(fan_in, fan_out)
        layers[f"act{i}"] = _activation(activation)
    layers["output"] = nn.Linear(sizes[-1], num_classes)
    return nn.Sequential(layers)


@dataclass(frozen=True)
class _ConvLayout:
    """One conv + pool stage: out channels, kernel, stride, padding, pool kernel and stride."""

    channels: int
    kernel: int
    stride: int
    padding: int
    pool: int
    pool_stride: int


# Tramèr & Boneh (2021), after Papernot et al. (2021): their 28×28 MNIST / Fashion-MNIST CNN.
_LAYOUT_28 = (_ConvLayout(16, 8, 2, 2, 2, 1), _ConvLayout(32, 4, 2, 0, 2, 1))
# The same two-stage shape scaled down for small images such as 8×8 digits (dpfy's choice).
_LAYOUT_SMALL = (_ConvLayout(16, 3, 1, 1, 2, 2), _ConvLayout(32, 3, 1, 1, 2, 2))
_SMALL_BELOW = 16  # images with a side shorter than this use the small layout


def _conv_stages(
    in_channels: int, layout: Sequence[_ConvLayout], activation: str, norm_groups: int | None
) -> OrderedDict[str, nn.Module]:
    """Conv → GroupNorm (optional) → activation → max-pool, once per layout stage."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    channels = in_channels
    for i, stage in enumerate(layout):
        layers[f"conv{i}"] = nn.Conv2d(
            channels, stage.channels, stage.kernel, stride=stage.stride, padding=stage.padding
        )
        if norm_groups is not None:
            if stage.channels % norm_groups:
                raise ValueError(f"norm_groups={norm_groups} must divide {stage.channels}")
            layers[f"norm{i}"] = nn.GroupNorm(norm_groups, stage.channels)
        layers[f"act{i}"] = _activation(activation)
        layers[f"pool{i}"] = nn.MaxPool2d(stage.pool, stride=stage.pool_stride)
        channels = stage.channels
    return layers


def _flat_size(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Size of the flattened feature map, found by one forward pass on a zero input."""
    try:
        with torch.no_grad():
            return int(features(torch.zeros(1, *input_shape)).numel())
    except RuntimeError as err:
        raise ValueError(f"cnn: input of shape {input_shape} is too small ({err})") from None


@register_model("cnn", "small tanh CNN with GroupNorm (Tramèr & Boneh 2021), for (C, H, W) images")
def _cnn(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    activation: str = "tanh",
    norm_groups: int | None = 4,
    hidden: int = 32,
) -> nn.Module:
    """The end-to-end CNN of Tramèr & Boneh (2021) for MNIST / Fashion-MNIST, with GroupNorm.

    Architecture (images of side ≥ 16, e.g. 28×28)::

        Conv2d(C→16, 8×8, stride 2, padding 2) → GroupNorm(4, 16) → tanh → MaxPool(2, stride 1)
        Conv2d(16→32, 4×4, stride 2)           → GroupNorm(4, 32) → tanh → MaxPool(2, stride 1)
        Flatten → Linear(→32) → tanh → Linear(→num_classes)

    For 28×28 inputs the feature maps are 13 → 12 → 5 → 4, so the flattened size is 512 and the
    model has ≈ 27k parameters. Smaller images (side < 16, e.g. 8×8 digits) cannot take the
    8×8 stride-2 stem, so they use the same two stages with 3×3 convolutions (padding 1) and
    2×2 stride-2 pooling (8 → 4 → 2). GroupNorm after each convolution is dpfy's addition: it is
    per-example, hence DP-safe (guide §5.5.1), and ``norm_groups=None`` removes it to get the
    paper's network exactly. Reference: F. Tramèr and D. Boneh, "Differentially Private
    Learning Needs Better Features (or Much More Data)", ICLR 2021: their end-to-end CNN for
    MNIST and Fashion-MNIST, taken from Papernot et al. 2021 ("Tempered Sigmoid Activations").
    """
    if len(input_shape) != 3:
        raise ValueError(
            f"cnn needs image input of shape (channels, height, width), got {input_shape}; "
            "use 'mlp' or 'logreg' for flat features"
        )
    layout = _LAYOUT_SMALL if min(input_shape[1:]) < _SMALL_BELOW else _LAYOUT_28
    features = nn.Sequential(_conv_stages(input_shape[0], layout, activation, norm_groups))
    flat = _flat_size(features, input_shape)
    layers = OrderedDict(features=features, flatten=nn.Flatten())
    layers["fc"] = nn.Linear(flat, hidden)
    layers["fc_act"] = _activation(activation)
    layers["output"] = nn.Linear(hidden, num_classes)
    return nn.Sequential(layers)
