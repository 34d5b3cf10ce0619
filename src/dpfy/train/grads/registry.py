"""Registry of per-layer rules for the fast engine, keyed on the layer class.

A rule is a small class of pure static functions with one shared signature:

* ``sq_norms(layer, call) -> Tensor[U]``: the squared norm of each clipping unit's gradient with
  respect to the layer's *own* trainable parameters (a unit is one example, or one microbatch);
* ``clipped_sum(layer, call, weights) -> dict[str, Tensor]``: ``Σ_u weights[u] · grad_u`` for each
  of the layer's own trainable parameters, computed without materialising ``grad_u``;
  ``add_clipped_sum`` may instead add it into the engine's running sum in place.

Rules are registered with :func:`register_rule` and looked up with :func:`find_rule`; the engines
never dispatch on layer types with if/elif. A layer class of an optional package is registered by
its qualified name (``"transformers.pytorch_utils.Conv1D"``), so that dpfy never imports the
package: the name is resolved to the class when a model holding one is first looked at, and only
the very class its module defines under that name gets the rule (an impostor does not).

A rule may also give each parameter's per-unit gradient as factors (:meth:`LayerRule.factors`);
a parameter shared by several layers (tied embeddings) then runs on the fast engine, its norm
taken of the summed gradient (see :mod:`dpfy.train.grads.shared`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torch import Tensor, nn

if TYPE_CHECKING:
    from dpfy.train.grads.capture import Call
    from dpfy.train.grads.rows import Rows

__all__ = ["LayerRule", "find_rule", "register_rule", "registered_layers", "registered_names"]


class LayerRule:
    """Base class of a rule: per-unit squared norms and the weighted gradient sum of one layer."""

    #: Whether the fast engine may stop autograd computing this layer's ordinary parameter
    #: gradient (the rule recomputes it, clipped). Only for layers whose forward is pure: the
    #: output may be re-rooted as a fresh leaf when no input requires grad.
    skip_param_grad: ClassVar[bool] = True

    #: Channels-first layers (convolutions, GroupNorm) see the batch in dim 0 even in a
    #: sequence-first model; see :func:`dpfy.train.grads.engine.GradEngine` on ``batch_first``.
    channels_first: ClassVar[bool] = False

    #: The parameters (by local name) whose per-unit gradients :meth:`factors` can give: only
    #: these may be shared with other layers on the fast engine.
    factored: ClassVar[frozenset[str]] = frozenset()

    @staticmethod
    def unsupported_reason(layer: nn.Module) -> str | None:
        """Say why this particular layer's configuration is outside the rule (None: supported)."""
        return None

    @staticmethod
    def per_example_grads(layer: nn.Module, call: Call) -> dict[str, Tensor | Rows] | None:
        """Per-example gradients (B, F) by name, where they are smaller than what is captured.

        Optional. The fast engine calls it during backward, as soon as the output gradient
        arrives, and then releases the call's inputs and output gradient, which lowers peak
        memory (e.g. convolutions: B·C_out·C_in·k² numbers instead of activations that scale
        with the image size). None: keep the call for ``sq_norms`` and ``clipped_sum``. A
        gradient formed in batch slices may come as :class:`dpfy.train.grads.rows.Rows`, not joined.
        """
        return None

    #: Whether the rule gives whole per-example gradients from the raw call (``example_rows``)
    #: instead of ``sq_norms`` and ``clipped_sum`` on a prepared one (recurrent layers, whose
    #: tensors do not share one batch dim).
    from_rows: ClassVar[bool] = False

    @staticmethod
    def example_rows(layer: nn.Module, call: Call) -> dict[str, Tensor] | None:
        """Per-example gradients (B, *shape) by name, from the call as captured (``from_rows``).

        None: the rule cannot read this call (e.g. a packed batch); the engine then forms the
        call's per-example gradients by replaying it, as the vmap engine does.
        """
        return None

    @staticmethod
    def sq_norms(layer: nn.Module, call: Call) -> Tensor:
        """Per-unit squared gradient norms over the layer's own trainable parameters."""
        raise NotImplementedError

    @staticmethod
    def clipped_sum(layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Weighted sum of per-unit gradients, by parameter name, never materialising them."""
        raise NotImplementedError

    @staticmethod
    def factors(layer: nn.Module, call: Call, name: str) -> tuple[Tensor, Tensor]:
        """Parameter ``name``'s per-unit gradient as ``Σ_t L_t R_tᵀ`` (one term per position).

        Returns ``(L, R)``: ``L`` (U, T, rows) floats, or (U, T) integer row indices standing for
        one-hot rows (an embedding's look-up), and ``R`` (U, T, cols), such that each unit's
        gradient, reshaped to (rows, cols), is ``Σ_t L_t R_tᵀ``. Needed only for the
        parameters in :attr:`factored`; inner products of two layers' gradients then need only
        T×T products (see :mod:`dpfy.train.grads.shared`).
        """
        raise NotImplementedError

    @classmethod
    def add_clipped_sum(
        cls, layer: nn.Module, call: Call, weights: Tensor, into: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Add the weighted sum into ``into[name]`` in place where that saves a temporary.

        ``into`` holds the engine's running sum (shaped like the parameter) for the parameters
        that have one. Rules of large layers add their product straight into it (e.g.
        ``addmm_``), so a step never holds a second parameter-sized tensor;
        whatever a rule does not add in place it returns, like :meth:`clipped_sum`, and the
        engine adds it. Default: nothing in place.
        """
        return cls.clipped_sum(layer, call, weights)


_RULES: dict[type[nn.Module], type[LayerRule]] = {}

#: Rules registered by qualified class name ("package.module.Class"), for optional packages.
_NAMED: dict[str, type[LayerRule]] = {}

#: What :func:`find_rule` answered for a layer class, beside what the answer was read from: the
#: class's MRO and ``forward``, and the registered class in that MRO (None: none) with its
#: ``forward`` then. The answer is a function of ``_RULES`` and of those alone, so a hit whose
#: four are still the same objects is the answer a fresh look-up would give; ``register_rule``
#: empties the cache, and a class whose bases or ``forward`` were reassigned misses it.
_FOUND: dict[type, tuple[tuple[type, ...], Any, type | None, Any, type[LayerRule] | None]] = {}

R = TypeVar("R", bound=type[LayerRule])


def register_rule(*layer_types: type[nn.Module] | str) -> Callable[[R], R]:
    """Class decorator: make ``rule`` the fast-engine rule for each of ``layer_types``.

    A layer type may be a qualified class name (``"transformers.pytorch_utils.Conv1D"``): the
    package is not imported, and the rule applies to the class its module defines by that name.
    """

    def decorate(rule: R) -> R:
        for layer_type in layer_types:
            if isinstance(layer_type, str):
                _NAMED[layer_type] = rule
            else:
                _RULES[layer_type] = rule
        _FOUND.clear()
        return rule

    return decorate


def _named_rule(cls: type) -> type[LayerRule] | None:
    """The rule registered under ``cls``'s qualified name, if ``cls`` is the class so named.

    The class must be what its (already imported) module holds under that name, so a class that
    merely copies the name gets nothing.
    """
    if not _NAMED:
        return None
    rule = _NAMED.get(f"{cls.__module__}.{cls.__qualname__}")
    if rule is None:
        return None
    module = sys.modules.get(cls.__module__)
    return rule if getattr(module, cls.__qualname__, None) is cls else None


def find_rule(layer: nn.Module) -> type[LayerRule] | None:
    """The rule for ``layer``: its exact class, or a subclass that keeps the parent's forward.

    A subclass overriding ``forward`` may compute anything, so it gets no rule (and falls back
    to the vmap engine) rather than a silently wrong one. Called for every layer call of every
    step, so the answer per class is kept (see ``_FOUND`` for why it cannot go stale).
    """
    cls = type(layer)
    hit = _FOUND.get(cls)
    if (
        hit is not None
        and hit[0] is cls.__mro__
        and hit[1] is cls.forward
        and (hit[2] is None or hit[3] is hit[2].forward)
    ):
        return hit[4]
    owner, rule = None, None
    for base in cls.__mro__:
        found = _RULES.get(base) or _named_rule(base)
        if found is not None:
            owner, rule = base, (found if cls.forward is base.forward else None)
            break
    _FOUND[cls] = (cls.__mro__, cls.forward, owner, None if owner is None else owner.forward, rule)
    return rule


def registered_layers() -> tuple[type[nn.Module], ...]:
    """All layer classes registered as classes (for documentation and error messages)."""
    return tuple(_RULES)


def registered_names() -> tuple[str, ...]:
    """The qualified class names rules were registered under (layers of optional packages)."""
    return tuple(_NAMED)
