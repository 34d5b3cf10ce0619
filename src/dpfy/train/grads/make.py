"""Choose and build a per-example gradient engine for a model."""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.nn.utils import parametrize

from dpfy.train.grads import recurrent as _recurrent  # noqa: F401 - recurrent layouts
from dpfy.train.grads import rules as _rules  # noqa: F401 - registers the layer rules
from dpfy.train.grads.capture import Tap
from dpfy.train.grads.engine import WATCHED, GradEngine
from dpfy.train.grads.fast import FastEngine
from dpfy.train.grads.hf_losses import guard_hf_losses
from dpfy.train.grads.hooks import refuse_gradient_hooks
from dpfy.train.grads.registry import LayerRule, find_rule
from dpfy.train.grads.substitutions import restore, substitute, substitution_blocker
from dpfy.train.grads.vmap import VmapEngine

__all__ = ["EngineChoice", "fast_blocker", "make_engine"]

EngineChoice = Literal["auto", "fast", "vmap"]


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's own (not its children's) parameters that require grad."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def _attention_blocker(model: nn.Module) -> str | None:
    """Why an attention module in ``model`` cannot be substituted (needed by both engines)."""
    if type(model) is nn.MultiheadAttention:
        return "the model itself is an nn.MultiheadAttention; wrap it in a container module"
    for name, module in model.named_modules():
        trainable = any(p.requires_grad for p in module.parameters())
        if type(module) is nn.MultiheadAttention and trainable:
            reason = substitution_blocker(module)
            if reason is not None:
                return f"layer '{name}': {reason}"
    return None


def fast_blocker(model: nn.Module) -> str | None:
    """The first reason the fast engine cannot run ``model`` (None: it can).

    Each trainable parameter is watched at its innermost owners (see :func:`_owners`), and
    each of those needs a rule. A parameter held by several layers (tied embeddings) needs a
    rule that factors its gradient in every one of them, so that the norm is taken of the sum;
    a layer registered twice (so called twice) is left to the vmap engine.
    """
    owners = _owners(model, innermost=True)
    uses: dict[int, list[tuple[str, nn.Module, str, type[LayerRule] | None]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        rule = None
        if type(module) is nn.MultiheadAttention:
            reason = substitution_blocker(module)
            if reason is not None:
                return f"layer '{name}': {reason}"
            own = _trainable(module)
        else:
            own = [(n, p) for n, p in _trainable(module) if id(module) in owners[id(p)]]
            if own:
                rule = find_rule(module)
                if rule is None:
                    return f"layer '{name}' ({type(module).__name__}) has no fast rule"
                reason = rule.unsupported_reason(module)
                if reason is not None:
                    return f"layer '{name}' ({type(module).__name__}): {reason}"
        for local, param in own:
            where = f"{name}.{local}" if name else local
            uses.setdefault(id(param), []).append((where, module, local, rule))
    for found in uses.values():
        if len(found) > 1:
            reason = _sharing_blocker(found)
            if reason is not None:
                return reason
    return None


def _sharing_blocker(uses: list[tuple[str, nn.Module, str, type[LayerRule] | None]]) -> str | None:
    """Why the fast engine cannot sum one parameter's gradients over the layers sharing it."""
    first = uses[0][0]
    seen: set[int] = set()
    for where, module, _, _ in uses:
        if id(module) in seen:
            return f"parameter '{first}' is also used as '{where}' (a layer used twice)"
        seen.add(id(module))
    for where, module, local, rule in uses:
        if rule is None or local not in rule.factored:
            return (
                f"parameter '{first}' is shared by several layers, and the fast rule of "
                f"'{where}' ({type(module).__name__}) cannot add its gradient to theirs"
            )
    return None


def _owners(model: nn.Module, *, innermost: bool) -> dict[int, set[int]]:
    """For each trainable parameter, the modules owning it that are watched for it.

    A parameter owned by a layer and by one of its sublayers too (Hugging Face's
    ``BertLMPredictionHead.bias`` is ``decoder.bias``) is watched once per chain of nesting:
    at the outer layer for the vmap engine (its calls cover every use of the parameter inside),
    at the inner one for the fast engine (the layer with a rule; a use by the outer layer
    outside that call then shows up as an ordinary gradient, which the engine refuses).
    Watching both would count it twice. Owners that are not nested (tied weights in two
    layers) each keep it.
    """
    paths: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for _, param in _trainable(module):
            paths.setdefault(id(param), []).append((name, module))

    def nested(path: str, other: str) -> bool:
        return _contains(path, other) if innermost else _contains(other, path)

    return {
        key: {
            id(module)
            for path, module in owners
            if not any(nested(path, other) for other, _ in owners if other != path)
        }
        for key, owners in paths.items()
    }


def _contains(outer: str, inner: str) -> bool:
    """Whether the module at path ``inner`` lies inside the module at path ``outer``."""
    return outer == "" or inner.startswith(outer + ".")


def _refuse_parametrizations(model: nn.Module) -> None:
    """A parametrized weight is recomputed by a call with no batch in it: no engine can run it."""
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            raise ValueError(
                f"layer '{name}' has a parametrized weight (torch.nn.utils.parametrize, e.g. "
                "parametrizations.weight_norm or spectral_norm), whose per-example gradients no "
                "engine here can compute; use torch.nn.utils.spectral_norm (the hook version) or "
                "train the layer without the parametrization"
            )


def make_engine(
    model: nn.Module, engine: EngineChoice = "auto", *, batch_first: bool = True
) -> GradEngine:
    """Attach a per-example clipping engine to ``model`` (see :mod:`dpfy.train.grads`).

    ``engine="auto"`` picks ``"fast"`` when every trainable layer has a rule, else ``"vmap"``
    (``fallback_reason`` says which layer forced it). ``batch_first`` says whether every watched
    layer sees the batch in dim 0 (True) or dim 1 (sequence-first models).
    """
    if engine not in ("auto", "fast", "vmap"):
        raise ValueError(f"engine must be 'auto', 'fast' or 'vmap', got {engine!r}")
    if any(module in WATCHED for module in model.modules()):
        raise ValueError("this model already has an engine attached; detach() it first")
    refuse_gradient_hooks({n: p for n, p in model.named_parameters() if p.requires_grad})
    blocker = fast_blocker(model)
    if engine == "fast" and blocker is not None:
        raise ValueError(
            f"the fast engine cannot run this model: {blocker}. "
            "Use make_engine(model, engine='vmap') or engine='auto'."
        )
    _refuse_parametrizations(model)
    attention = _attention_blocker(model)
    if attention is not None:
        raise ValueError(f"no engine can run this model: {attention}")
    for name, module in model.named_modules():
        if type(module) is nn.MultiheadAttention and module.batch_first != batch_first:
            raise ValueError(
                f"layer '{name}' has batch_first={module.batch_first} but the engine was made "
                f"with batch_first={batch_first}; they must agree"
            )
    kind = "fast" if engine == "fast" or (engine == "auto" and blocker is None) else "vmap"
    names = {id(p): n for n, p in model.named_parameters()}
    substitutions = substitute(model)
    loss_guard = guard_hf_losses(model)
    try:
        taps = []
        owners = _owners(model, innermost=kind == "fast")
        for name, module in model.named_modules():
            own = [(n, p) for n, p in _trainable(module) if id(module) in owners[id(p)]]
            if not own:
                continue
            rule = find_rule(module) if kind == "fast" else None
            taps.append(
                Tap(
                    name=name,
                    module=module,
                    trainable=frozenset(n for n, _ in own),
                    skip_param_grad=rule is not None and rule.skip_param_grad,
                )
            )
        common = dict(
            batch_first=batch_first,
            substitutions=substitutions,
            param_names=names,
            loss_guard=loss_guard,
        )
        if kind == "fast":  # under "auto", a layer called twice is replayed as vmap would
            return FastEngine(model, taps, replay_repeated=engine == "auto", **common)
        reason = blocker if engine == "auto" else None
        return VmapEngine(model, taps, fallback_reason=reason, **common)
    except Exception:
        restore(substitutions)
        loss_guard.remove()
        raise
