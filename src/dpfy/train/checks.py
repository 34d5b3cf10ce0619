"""Pitfall detectors that run before training starts.

Model part (guide §5.5.1): batch normalisation computes each example's output from
statistics of the whole batch, so an example's "per-example" gradient depends on the other
examples and clipping it no longer bounds that example's influence. Running statistics kept by
BatchNorm or by InstanceNorm with ``track_running_stats=True`` are averages of private batches,
updated without noise and used at evaluation: they leak the data outside the DP guarantee. Layer,
group and weight normalisation, and InstanceNorm without running statistics, are per-example and
safe. An embedding built with ``max_norm`` renormalises the rows the batch looks up, in place,
during the forward pass: a data-dependent write to the parameters outside clipping and noise.

:func:`check_model` refuses such models with one ValueError naming every offending layer and the
fix; :func:`fix` replaces those layers (BatchNorm → GroupNorm, InstanceNorm → the same
InstanceNorm without running statistics) and touches nothing else.

:func:`find_sparse_gradient_layers` lists embeddings with sparse gradients for the privacy report
(guide §5.4.1, tab. 5); dpfy noises every coordinate densely, so they are noted, not refused. The
run-level pitfall detectors that read a run's facts live in :mod:`dpfy.report.pitfalls`.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.lazy import LazyModuleMixin

# GroupNorm groups: gcd(32, C). 32 groups is the GroupNorm paper's default; the gcd makes it
# divide any channel count (64 → 32, 48 → 16, 10 → 2, a prime C → 1, i.e. LayerNorm over C×…).
_DEFAULT_GROUPS = 32


@dataclass(frozen=True)
class ModelFinding:
    """One layer that breaks the DP guarantee, why, and how to fix it — for errors and reports."""

    path: str
    layer: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({self.layer}): {self.problem} Fix: {self.fix}"


@dataclass(frozen=True)
class Replacement:
    """One layer :func:`fix` replaced."""

    path: str
    before: str
    after: str

    def __str__(self) -> str:
        return f"{self.path or '<model>'}: {self.before} → {self.after}"


_BATCH_NORM_PROBLEM = (
    "batch normalisation couples the examples of a batch (each output uses the batch's "
    "statistics), so per-example gradients are not per-example and clipping them does not bound "
    "one example's influence; its running statistics are also un-noised averages of private "
    "data (guide §5.5.1)."
)
_BATCH_NORM_FIX = (
    "model = dpfy.fix(model), which swaps it for GroupNorm, or use GroupNorm/LayerNorm."
)
_INSTANCE_NORM_PROBLEM = (
    "track_running_stats=True accumulates un-noised averages of private batches and uses them at "
    "evaluation, which leaks training data outside the DP guarantee (guide §5.5.1)."
)
_INSTANCE_NORM_FIX = (
    "model = dpfy.fix(model), or build the layer with track_running_stats=False "
    "(normalising each example by its own statistics is safe)."
)


def find_batch_coupled_layers(model: nn.Module) -> tuple[ModelFinding, ...]:
    """Every layer of ``model`` that couples examples, or writes to itself from data in forward."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    findings = []
    for path, module in model.named_modules():
        finding = _inspect(path, module)
        if finding is not None:
            findings.append(finding)
    return tuple(findings)


def _inspect(path: str, module: nn.Module) -> ModelFinding | None:
    """The finding for one module, or None if it is per-example."""
    if isinstance(module, _BatchNorm):
        return ModelFinding(path, type(module).__name__, _BATCH_NORM_PROBLEM, _BATCH_NORM_FIX)
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        return ModelFinding(path, type(module).__name__, _INSTANCE_NORM_PROBLEM, _INSTANCE_NORM_FIX)
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
        return ModelFinding(path, type(module).__name__, _MAX_NORM_PROBLEM, _MAX_NORM_FIX)
    return None


_MAX_NORM_PROBLEM = (
    "max_norm renormalises, in place during the forward pass, the embedding rows the batch looks "
    "up: the weights change with the private data outside clipping and noise, un-noised."
)
_MAX_NORM_FIX = (
    "model = dpfy.fix(model), which sets max_norm=None, or build the layer without max_norm "
    "(clipping bounds each example's influence instead)."
)


_SPARSE_PROBLEM = (
    "sparse=True makes the layer's plain gradient touch only the rows of the batch; a "
    "sparse-aware update that skips zero rows would leave them un-noised and break the guarantee "
    "(guide §5.4.1, tab. 5). dpfy adds dense noise to every coordinate of every trainable "
    "parameter, so the guarantee holds, but the update is dense."
)
_SPARSE_FIX = (
    "nothing is needed for correctness with dpfy; build the layer with sparse=False to avoid "
    "converting sparse gradients, and never pair it with an optimizer that skips zero rows."
)


def find_sparse_gradient_layers(model: nn.Module) -> tuple[ModelFinding, ...]:
    """Every embedding layer built with ``sparse=True`` (a report note, not a refusal)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return tuple(
        ModelFinding(path, type(module).__name__, _SPARSE_PROBLEM, _SPARSE_FIX)
        for path, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
    )


def check_model(model: nn.Module, *, strict: bool = True) -> tuple[ModelFinding, ...]:
    """Refuse a model with batch-coupled layers, or list them.

    With ``strict`` (the default) any finding raises one ValueError listing every offending layer
    with the reason and the fix; otherwise the findings are returned for a report.
    """
    findings = find_batch_coupled_layers(model)
    if findings and strict:
        listing = "\n".join(f"  - {f}" for f in findings)
        raise ValueError(
            f"the model has {len(findings)} layer(s) that break differential privacy:\n{listing}\n"
            "Run `model = dpfy.fix(model)` before building the optimizer to replace them."
        )
    return findings


def fix_model(
    model: nn.Module, *, inplace: bool = False
) -> tuple[nn.Module, tuple[Replacement, ...]]:
    """Replace every batch-coupled layer; return the model and what was replaced.

    BatchNorm (any dimension, Sync, Lazy) becomes ``GroupNorm(gcd(32, C), C)`` with the same
    ``eps``, and the same affine weight and bias when it had them (so e.g. a zero-initialised last
    norm of a residual block stays zero). InstanceNorm with running statistics becomes the same
    InstanceNorm with ``track_running_stats=False`` and its parameters. Nothing else changes.
    By default the model is deep-copied first; build the optimizer from the returned model.
    """
    find_batch_coupled_layers(model)  # validates the type
    for module in model.modules():  # before copying: an unmaterialised layer cannot be copied
        if _inspect("", module) is not None:
            _refuse_uninitialised(module)
    if not inplace:
        model = copy.deepcopy(model)
    replacements = []
    root_finding = _inspect("", model)
    if root_finding is not None:
        new = _replacement_for(model)
        replacements.append(Replacement("", repr(model), repr(new)))
        return new, tuple(replacements)
    done: dict[int, nn.Module] = {}  # a layer shared by several parents stays shared
    for path, parent in list(model.named_modules()):
        # _modules, not named_children(), which skips a second slot holding the same layer
        for name, child in list(parent._modules.items()):
            if child is None or _inspect(name, child) is None:
                continue
            if id(child) not in done:
                done[id(child)] = _replacement_for(child)
                child_path = f"{path}.{name}" if path else name
                replacements.append(Replacement(child_path, repr(child), repr(done[id(child)])))
            setattr(parent, name, done[id(child)])
    return model, tuple(replacements)


def fix(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """The model with batch-coupled layers replaced (see :func:`fix_model`); warns what changed."""
    fixed, replacements = fix_model(model, inplace=inplace)
    if replacements:
        listing = "; ".join(str(r) for r in replacements)
        warnings.warn(
            f"dpfy.fix replaced {len(replacements)} layer(s) for DP training: {listing}",
            UserWarning,
            stacklevel=2,
        )
    return fixed


def _replacement_for(module: nn.Module) -> nn.Module:
    """The per-example, stateless stand-in for one batch-coupled layer."""
    _refuse_uninitialised(module)
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        new = copy.copy(module)  # the same weight, without the in-place renormalisation
        new.max_norm = None
        return new
    if isinstance(module, _BatchNorm):
        channels = module.num_features
        new: nn.Module = nn.GroupNorm(
            math.gcd(_DEFAULT_GROUPS, channels), channels, eps=module.eps, affine=module.affine
        )
    else:
        new = type(module)(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=False,
        )
    if module.affine:
        new.weight = module.weight
        new.bias = module.bias
    tensors = [*module.parameters(), *module.buffers()]
    if tensors:
        reference = tensors[0]
        new = new.to(device=reference.device, dtype=reference.dtype)
    new.train(module.training)
    return new


def _refuse_uninitialised(module: nn.Module) -> None:
    """A lazy layer that has not seen data has no channel count to build a replacement from."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(
            f"{type(module).__name__} has not seen data yet, so its channel count is unknown; "
            "run one forward pass on public or dummy data first, or replace it by hand with "
            "GroupNorm/LayerNorm"
        )
