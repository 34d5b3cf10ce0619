"""A training variant is one composed object, registered once: what makes a new algorithm.

Each variant — an algorithm at a unit of privacy — names its components: the resolver that fixes
its privacy plan (batch selection, clipping unit, noise mechanism and the privacy event they make
together, :mod:`dpfy.plan.privacy_plan`), the batch selection the training side builds
(``batches``, a key of :mod:`dpfy.train.variants`), whether it spans processes or splits batches,
and the words the report and the command line use. A new mechanism is its own module in this
package, one :func:`register_variant` call, and its noise mechanism's registration in
:mod:`dpfy.train.noise`; the builder, the jobs, the CLI and the report read the variant from here
and never branch on its name (the shape of JAX Privacy's ``DPExecutionPlan``: each variant swaps
components, never the step). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.variants.request import PlanRequest
from dpfy.plan.variants.text import AlgorithmText, UserLevelText

__all__ = [
    "Resolver",
    "TrainingVariant",
    "make_plan",
    "register_variant",
    "trained_algorithms",
    "variant_for",
    "variant_keys",
    "variants",
]

Resolver = Callable[[PlanRequest], PrivacyPlan]


@dataclass(frozen=True)
class TrainingVariant:
    """One algorithm at one unit of privacy, as every stage sees it.

    ``batches`` is the batch selection :func:`dpfy.make_private` builds (None: the variant is
    trained elsewhere, e.g. ``dpfy.federated``); ``distributed`` whether it may span ranks;
    ``virtual_batches`` whether a logical batch may be split into chunks (a user's examples are
    one clipping unit and cannot be). ``user_text`` is what a user-level variant clips per user.
    """

    algorithm: str
    unit: str
    label: str
    resolve: Resolver
    text: AlgorithmText
    batches: str | None = None
    distributed: bool = False
    virtual_batches: bool = True
    user_text: UserLevelText | None = None

    @property
    def key(self) -> tuple[str, str]:
        """(algorithm, unit): where it is registered."""
        return self.algorithm, self.unit


_VARIANTS: dict[tuple[str, str], TrainingVariant] = {}


def register_variant(variant: TrainingVariant) -> TrainingVariant:
    """Register ``variant`` under (algorithm, unit); a second registration of a key is refused."""
    if variant.key in _VARIANTS:
        raise ValueError(f"a variant is already registered as {variant.key}")
    if variant.unit not in ("example", "user"):
        raise ValueError(f"a variant's unit must be 'example' or 'user', got {variant.unit!r}")
    if variant.unit == "user" and variant.user_text is None:
        raise ValueError(f"the user-level variant {variant.algorithm} needs its user_text")
    _VARIANTS[variant.key] = variant
    return variant


def variants() -> tuple[TrainingVariant, ...]:
    """Every registered variant, in registration order."""
    return tuple(_VARIANTS.values())


def variant_keys() -> tuple[tuple[str, str], ...]:
    """Every (algorithm, unit) a plan can be made for."""
    return tuple(_VARIANTS)


def trained_algorithms() -> tuple[str, ...]:
    """The algorithms make_private trains (at some unit), in registration order."""
    return tuple(dict.fromkeys(v.algorithm for v in _VARIANTS.values() if v.batches))


def variant_for(algorithm: str, unit: str) -> TrainingVariant:
    """The variant of (``algorithm``, ``unit``), or one error naming the choices."""
    key = (str(algorithm).strip().lower(), unit)
    if key not in _VARIANTS:
        known = ", ".join(sorted({name for name, _ in _VARIANTS}))
        units = sorted(u for name, u in _VARIANTS if name == key[0])
        if units:
            raise ValueError(
                f"{key[0]} is available at the {' and '.join(units)} level, not per {unit}; "
                f"{'drop user_ids' if unit == 'user' else 'pass user_ids'} or choose another "
                "algorithm"
            )
        raise ValueError(f"algorithm must be one of {known}; got {algorithm!r}")
    return _VARIANTS[key]


def make_plan(
    request: PlanRequest, algorithm: str = "dp-sgd", unit: str = "example"
) -> PrivacyPlan:
    """The plan for ``request`` from the resolver of (``algorithm``, ``unit``)."""
    return variant_for(algorithm, unit).resolve(request)
