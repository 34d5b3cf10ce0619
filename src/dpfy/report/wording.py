"""The report's phrases for each algorithm, unit of privacy and sampler, looked up by name.

Sections and pitfall detectors read attributes of a :class:`Wording` looked up once from a run's
privacy plan (:func:`wording_for`) instead of branching on mode names, so an algorithm or unit
brings its own sentences here rather than a branch in every section. Variants are registered
with the plan (:mod:`dpfy.plan.variants`): each brings its algorithm's sentences, and a name
without wording is one clear error.
Templates are filled with :meth:`str.format`; no sentence is rewritten after it is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from dpfy.plan.variants import TrainingVariant, variants
from dpfy.plan.variants.text import AlgorithmText as AlgorithmWording

if TYPE_CHECKING:
    from dpfy.plan.privacy_plan import PrivacyPlan


@dataclass(frozen=True)
class UnitWording:
    """How the report names one unit of privacy: what one protected record is (guide §2.1)."""

    record: str  # what two neighbouring datasets differ by
    joined: str  # how Poisson sampling draws records, as in "{joined} independently"
    groups_examples: bool  # one record holds several examples: users and examples are stated
    hyperparameter_rows: tuple[tuple[str, str, str], ...] = ()  # extra (key, symbol, label)
    hyperparameter_labels: tuple[tuple[str, str], ...] = ()  # (key, label) said differently


@dataclass(frozen=True)
class VariantWording:
    """One algorithm at one unit of privacy: how it clips, and what it adds to the unit section."""

    algorithm: AlgorithmWording
    unit: UnitWording
    clipping: str  # the clipping assumption; field {c}
    microbatch_clipping: str | None = None  # with microbatches; fields {k}, {sensitivity}
    detail: str = ""  # fields {users}, {examples}, {q}, {used}; only where records are groups


@dataclass(frozen=True)
class SamplerWording:
    """How the report states one sampler's assumption and what B/N is for it (guide §4.3)."""

    assumption: str  # whether the accounting's assumption held; fields {joined}, {eps}, {batch}
    rate_label: str  # what B/N is
    poisson_comparison: bool  # whether ε under the Poisson assumption compares with anything


@dataclass(frozen=True)
class Wording:
    """Every phrase one run's report uses, looked up once from its privacy plan."""

    variant: VariantWording
    sampler: SamplerWording

    @property
    def algorithm(self) -> AlgorithmWording:
        """The algorithm's phrases."""
        return self.variant.algorithm

    @property
    def unit(self) -> UnitWording:
        """The unit of privacy's phrases."""
        return self.variant.unit

    def clipping(self, plan: PrivacyPlan) -> str:
        """The clipping assumption of ``plan``, said for microbatches where the variant has them."""
        variant = self.variant
        microbatched = plan.microbatch_size is not None and variant.microbatch_clipping is not None
        template = variant.microbatch_clipping if microbatched else variant.clipping
        return str(template).format(
            c=plan.max_grad_norm, k=plan.microbatch_size, sensitivity=plan.sensitivity
        )


# -- algorithms: each variant brings its own words (dpfy.plan.variants) ----------------------------

ALGORITHM_WORDING: dict[str, AlgorithmWording] = {v.algorithm: v.text for v in variants()}

# -- units of privacy -----------------------------------------------------------------------------

UNIT_WORDING: dict[str, UnitWording] = {
    "example": UnitWording(
        record="one record", joined="every example joined each batch", groups_examples=False
    ),
    # dpfy.train.user_level and dpfy.federated: N and B count users, and two more rows say what
    # a user is.
    "user": UnitWording(
        record="one user (all of that user's examples)",
        joined="every user joined each step",
        groups_examples=True,
        hyperparameter_rows=(
            ("examples", "", "training examples held by the users"),
            ("max_examples_per_user", "", "max examples per sampled user (— = all)"),
        ),
        hyperparameter_labels=(
            ("dataset_size", "users"),
            ("sampling_rate", "user sampling rate B/N"),
            ("expected_batch_size", "expected users per step"),
        ),
    ),
}

# -- variants: an algorithm at a unit of privacy --------------------------------------------------

_PER_EXAMPLE = "per-example clipping to C, sensitivity C = {c:g}."
_MICROBATCH = (
    "microbatches of {k} examples, the average gradient of each clipped to C: sensitivity "
    "2C = {sensitivity:g}, noise std 2σC (guide alg. 3)."
)
_USERS_HOLD = "{users} users hold the {examples} training examples; "


def _per_user(contribution: str) -> str:
    """Per-user clipping of each sampled user's ``contribution``."""
    return (
        f"per-user clipping: each sampled user's {contribution} is clipped to C, so adding or "
        "removing one user moves the sum by at most C = {c:g}."
    )


def _variant_wording(variant: TrainingVariant) -> VariantWording:
    """One registered variant's phrases: its algorithm's words at its unit of privacy."""
    if variant.user_text is None:
        return VariantWording(variant.text, UNIT_WORDING[variant.unit], _PER_EXAMPLE, _MICROBATCH)
    return VariantWording(
        variant.text,
        UNIT_WORDING["user"],
        _per_user(variant.user_text.clipped),
        detail=_USERS_HOLD + variant.user_text.detail,
    )


VARIANT_WORDING: dict[tuple[str, str], VariantWording] = {
    variant.key: _variant_wording(variant) for variant in variants()
}

# -- samplers (by dpfy.plan.sampling.SamplingKind value) ------------------------------------------

_Q = "q (sampling rate)"


def _tree_order(order: str) -> SamplerWording:
    """DP-FTRL's batches in ``order``: no sampling, so no assumption and no Poisson figure."""
    return SamplerWording(
        f"Met — no sampling assumption was used: batches of B = {{batch}} were taken in {order} "
        "order, each example at most once per epoch, and DP-FTRL's tree aggregation is accounted "
        "for any such order (Kairouz et al. 2021).",
        "B/N (batch fraction; nothing is sampled)",
        poisson_comparison=False,
    )


SAMPLER_WORDING: dict[str, SamplerWording] = {
    "poisson": SamplerWording(
        "Met: {joined} independently with probability q (Poisson sampling), as the accountant "
        "assumes.",
        _Q,
        poisson_comparison=True,
    ),
    "truncated-poisson": SamplerWording(
        "Met: {joined} independently with probability q (Poisson sampling); a batch of more than "
        "M = {max_batch} examples kept M of them chosen at random, and every batch was padded "
        "to M rows whose padding weighed exactly 0. The chance that a step's batch was cut, "
        "P[Binomial(N + 1, q) > M] = {cut:.3g} per step, was charged in δ: the run is "
        "(ε, δ_Poisson(ε) + (1 + e^ε)·T·{cut:.3g})-DP, a coupling with untruncated Poisson "
        "sampling (T steps).",
        _Q,
        poisson_comparison=True,
    ),
    "balls-in-bins": SamplerWording(
        "Met: at the start of every epoch each example was assigned to one of its k = N // B "
        "batches uniformly at random (balls-in-bins, Chua et al. 2025), so it took part in "
        "exactly one step per epoch. ε is the random-allocation bound (Feldman & Shenfeld, "
        '"Privacy amplification by random allocation", 2025): each epoch is charged at its '
        "first step, in full, as one example allocated to 1 of k Gaussian steps of noise σ, "
        "dominated by the pair (1/k)Σⱼ N(eⱼ/σ, I) vs N(0, I) in both directions of "
        "add-or-remove, and computed as a proven upper bound (a pessimistic discretisation of "
        "its privacy loss distribution, no Monte Carlo). ε under the Poisson assumption = {eps} "
        "is for comparison only.",
        "B/N (1/k: each example is in one of the epoch's k batches)",
        poisson_comparison=True,
    ),
    "shuffle": SamplerWording(
        "NOT met: batches were shuffled fixed-size batches (one pass per epoch), but ε is "
        "computed as if they were Poisson-sampled at q = B/N. ε under the Poisson assumption = "
        "{eps}; no upper bound on ε is proven for shuffled batches (guide §4.3), only the lower "
        "bound in section 7.",
        _Q,
        poisson_comparison=True,
    ),
    "fixed-size": SamplerWording(
        "Met: batches of a fixed size drawn uniformly at every step, accounted honestly as "
        "fixed-size subsampling under replace-one adjacency (not as Poisson).",
        _Q,
        poisson_comparison=True,
    ),
    "tree-shuffle": _tree_order("a shuffled"),
    "tree-fixed-order": _tree_order("a fixed"),
    "cyclic-poisson": SamplerWording(
        "Met: the examples were split once into fixed groups, independently of the data, and "
        "every example of the step's group joined it independently with probability q (cyclic "
        "Poisson sampling), as amplified BandMF's accounting assumes.",
        "q (sampling rate within the step's group, b·B/N)",
        poisson_comparison=False,
    ),
    "fixed-order-epochs": SamplerWording(
        "Met — no sampling assumption was used: batches of B = {batch} were taken in one order "
        "drawn before training (independently of the data) and repeated every epoch, so each "
        "example took part at most once per epoch, always N // B steps apart: the "
        "participation the matrix-factorisation accounting assumes.",
        "B/N (batch fraction; nothing is sampled)",
        poisson_comparison=False,
    ),
}

# -- what a statement says about the plan beyond σ and q -------------------------------------------


def accounting_fields(plan: PrivacyPlan) -> dict[str, object]:
    """Fields of the accounting statement beyond accountant, σ and q: for matrix-factorisation
    noise, the strategy, the participation and the sensitivity behind ε (none otherwise)."""
    from dpfy.plan.correlated_events import (
        CORRELATED_MECHANISMS,
        CyclicCharges,
        describe_strategy,
    )

    if plan.mechanism not in CORRELATED_MECHANISMS:
        return {}
    charges = plan.charges()
    numbers = ", ".join(f"{v:.4g}" for v in plan.strategy or ())
    layout = "coefficients 1, c_1, …" if plan.mechanism == "banded-mf" else "decays, then weights"
    fields: dict[str, object] = {
        "strategy": f"{describe_strategy(plan.mechanism, plan.strategy)} ({layout}: {numbers})",
        "planned": plan.steps,
    }
    if isinstance(charges, CyclicCharges):
        column = charges.column.norm
        fields["charged"] = (
            f"Amplified BandMF (Choquette-Choo et al. 2023): the examples were split once, before "
            f"training and independently of the data, into b = {charges.groups} groups, and "
            f"each step Poisson-sampled the next group at q = {charges.sampling_rate:.6g}; with "
            "no more bands than groups an example's rounds touch disjoint rows of C, so the run "
            f"is ⌈T/b⌉ = {charges.rounds} composed Poisson-subsampled Gaussians of noise "
            f"multiplier σ/‖largest column of C‖ = {plan.noise_multiplier / column:.6g} "
            f"(‖·‖ = {column:.6g}), one charged at every {charges.groups}-th step. Adjacency "
            "adds or removes one example."
        )
        return fields
    k = len(charges.sensitivities)
    total = charges.total
    exact = ("exact: " if total.exact else "an upper bound: ") + total.method
    fields["charged"] = (
        "NO sampling assumption is used. Participation (min-separation): each example in at "
        f"most k = {k} step{'s' if k != 1 else ''} (one per epoch), exactly "
        f"s = {charges.steps_per_epoch} steps apart. The planned run is one Gaussian mechanism "
        f"of noise multiplier σ/Δ = {plan.noise_multiplier / total.norm:.6g}, Δ = "
        f"{total.norm:.6g} being the strategy's sensitivity in units of the clip norm ({exact}; "
        "Denisov et al. 2022, Choquette-Choo et al. 2022); the ledger charges it epoch by epoch, "
        "at each epoch's first step the Gaussian that brings the composition to σ/Δ for the "
        "epochs begun. Adjacency replaces an example by a null one (the order is fixed in "
        "advance)."
    )
    return fields


# -- looking wording up ---------------------------------------------------------------------------

_Phrases = TypeVar("_Phrases")


def known(what: str, name: str, registry: Mapping[str, _Phrases]) -> _Phrases:
    """The registry's phrases for ``name``, or one error naming what the report can word."""
    if name not in registry:
        raise ValueError(
            f"the report has no wording for {what} {name!r}; it words {', '.join(registry)}"
        )
    return registry[name]


def unit_wording(unit: str) -> UnitWording:
    """The phrases of one unit of privacy ('example' or 'user')."""
    return known("unit of privacy", unit, UNIT_WORDING)


def sampler_wording(sampler: str) -> SamplerWording:
    """The phrases of one sampler, by its SamplingKind value."""
    return known("sampler", sampler, SAMPLER_WORDING)


def wording_for(plan: PrivacyPlan) -> Wording:
    """The phrases for ``plan``: its algorithm at its unit of privacy, and its sampler.

    Read from the registered variants at call time, so a variant registered after this module
    was imported is worded too.
    """
    registered = {variant.key: variant for variant in variants()}
    known("algorithm", plan.algorithm, {a: v for (a, _), v in registered.items()})
    unit_wording(plan.unit)
    variant = registered.get((plan.algorithm, plan.unit))
    if variant is None:
        worded = ", ".join(f"{a} at the {u} level" for a, u in registered)
        raise ValueError(
            f"the report has no wording for {plan.algorithm} at the {plan.unit} level; it words "
            f"{worded}"
        )
    return Wording(_variant_wording(variant), sampler_wording(plan.sampler))


__all__ = [
    "ALGORITHM_WORDING",
    "SAMPLER_WORDING",
    "UNIT_WORDING",
    "VARIANT_WORDING",
    "AlgorithmWording",
    "SamplerWording",
    "UnitWording",
    "VariantWording",
    "Wording",
    "accounting_fields",
    "known",
    "sampler_wording",
    "unit_wording",
    "wording_for",
]
