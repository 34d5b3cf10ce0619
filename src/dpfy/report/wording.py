"""The report's phrases for each algorithm, unit of privacy and sampler, looked up by name.

Sections and pitfall detectors read attributes of a :class:`Wording` looked up once from a run's
privacy plan (:func:`wording_for`) instead of branching on mode names, so an algorithm or unit
brings its own sentences here rather than a branch in every section. Variants are registered
by (algorithm, unit), as the plan's resolvers are; a name without wording is one clear error.
Templates are filled with :meth:`str.format`; no sentence is rewritten after it is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from dpfy.plan.privacy_plan import PrivacyPlan


@dataclass(frozen=True)
class AlgorithmWording:
    """How the report names one training algorithm and what it noises (guide §3, §4.2, §4.4)."""

    name: str  # as in "full-training DP via {name}"
    curator: str  # who sees the raw data, and what the guarantee protects
    guide: str  # where the guide describes the setting
    released_from: str  # what the released models are computed from
    steps: str  # what the ε counts, in the plural
    accounting: str  # how it is accounted; fields {accountant}, {sigma}, {q}
    clipped: str  # the vector clipped once per unit, as in "per-example {clipped} norms"


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


# -- algorithms -----------------------------------------------------------------------------------


def _gaussian_accounting(clipped_sum: str) -> str:
    """A subsampled-Gaussian accounting statement, noise on the sum of clipped ``clipped_sum``."""
    return (
        "Accounted with the {accountant} accountant over every recorded step: each step is the "
        "subsampled Gaussian mechanism with noise multiplier σ = {sigma:.6g} (noise std "
        f"σ·sensitivity on the sum of clipped {clipped_sum}, decoupled from C, guide §4.2) at "
        "sampling rate q = {q:.6g}."
    )


_TREE_ACCOUNTING = (  # Kairouz et al. 2021, App. D; dpfy.plan.tree_events
    "DP-FTRL with tree aggregation, accounted with the {accountant} accountant and NO sampling "
    "assumption: every node of the binary tree over the steps carries Gaussian noise of std "
    "σ·sensitivity (σ = {sigma:.6g}); one example's clipped gradient sits in at most "
    "⌈log₂(T+1)⌉ nodes of a tree of T steps and enters each tree at most once, so each epoch is "
    "a Gaussian mechanism of noise σ/√⌈log₂(T+1)⌉ and epochs compose. Adjacency replaces an "
    "example by a null one (the order is kept)."
)
_CENTRAL = (
    "a trusted curator: the training process sees the raw private data, and only its outputs "
    "are protected"
)


def _factorised_accounting(name: str) -> str:
    """Matrix-factorisation noise (dpfy.plan.correlated_events), accounted by participation."""
    return (
        f"{name} matrix-factorisation noise, accounted with the {{accountant}} accountant: step t "
        "adds σ·sensitivity·(C⁻¹z)_t to its clipped sum, z fresh N(0, I) every step "
        "(σ = {sigma:.6g}), so the noise is correlated across steps and partly cancels in the "
        "running sum. Strategy C: {strategy}, optimised for this run's {planned} steps and its "
        "participation when the run was planned. {charged}"
    )


def _federated(name: str) -> AlgorithmWording:
    """dpfy.federated: the server is the trusted curator and each round is one noised average."""
    return AlgorithmWording(
        name=name,
        curator=(
            "a trusted aggregator: the server sees each sampled user's model change in the "
            "clear, and only the noised global models are protected"
        ),
        guide="guide §3.1–§3.2, §4.4",
        released_from="the noised averages of clipped user model changes",
        steps="noised rounds",
        accounting=_gaussian_accounting("user model changes"),
        clipped="model-change",
    )


ALGORITHM_WORDING: dict[str, AlgorithmWording] = {
    "dp-sgd": AlgorithmWording(
        name="DP-SGD",
        curator=_CENTRAL,
        guide="guide §3.1–§3.2",
        released_from="the noised gradients",
        steps="noised gradient steps",
        accounting=_gaussian_accounting("gradients"),
        clipped="gradient",
    ),
    "dp-ftrl": AlgorithmWording(
        name="DP-FTRL (Kairouz et al. 2021)",
        curator=_CENTRAL,
        guide="guide §3.1–§3.2",
        released_from="the noised gradients",
        steps="noised gradient steps",
        accounting=_TREE_ACCOUNTING,
        clipped="gradient",
    ),
    "bandmf": AlgorithmWording(
        name="BandMF (banded matrix factorisation, Choquette-Choo et al. 2023; McKenna 2024)",
        curator=_CENTRAL,
        guide="guide §3.1–§3.2",
        released_from="the noised gradients",
        steps="noised gradient steps",
        accounting=_factorised_accounting("BandMF (banded)"),
        clipped="gradient",
    ),
    "blt": AlgorithmWording(
        name="BLT (buffered linear Toeplitz matrix factorisation, Dvijotham, McMahan et al. 2024)",
        curator=_CENTRAL,
        guide="guide §3.1–§3.2",
        released_from="the noised gradients",
        steps="noised gradient steps",
        accounting=_factorised_accounting("BLT (buffered linear Toeplitz)"),
        clipped="gradient",
    ),
    "dp-fedavg": _federated("DP-FedAvg"),
    "dp-fedsgd": _federated("DP-FedSGD"),
}

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


def _federated_variant(name: str) -> VariantWording:
    """DP-FedAvg / DP-FedSGD (guide alg. 2): a user's whole model change is the clipped unit."""
    return VariantWording(
        ALGORITHM_WORDING[name],
        UNIT_WORDING["user"],
        _per_user("model change after local training"),
        detail=_USERS_HOLD
        + "each round samples users with probability q = {q:.6g}, each sampled user trains "
        "locally on their own examples, and their whole model change is clipped to C as one "
        f"unit ({ALGORITHM_WORDING[name].name}, guide alg. 2, McMahan et al. 2018).",
    )


VARIANT_WORDING: dict[tuple[str, str], VariantWording] = {
    ("dp-sgd", "example"): VariantWording(
        ALGORITHM_WORDING["dp-sgd"], UNIT_WORDING["example"], _PER_EXAMPLE, _MICROBATCH
    ),
    ("dp-sgd", "user"): VariantWording(  # user-level DP-SGD, McMahan et al. 2018
        ALGORITHM_WORDING["dp-sgd"],
        UNIT_WORDING["user"],
        _per_user("mean gradient"),
        detail=_USERS_HOLD
        + "each step samples users (not examples) with probability q = {q:.6g}, and each "
        "sampled user's gradient is the mean over {used}, clipped to C as one unit (user-level "
        "DP-SGD, McMahan et al. 2018).",
    ),
    ("dp-ftrl", "example"): VariantWording(
        ALGORITHM_WORDING["dp-ftrl"], UNIT_WORDING["example"], _PER_EXAMPLE, _MICROBATCH
    ),
    ("bandmf", "example"): VariantWording(
        ALGORITHM_WORDING["bandmf"], UNIT_WORDING["example"], _PER_EXAMPLE, _MICROBATCH
    ),
    ("blt", "example"): VariantWording(
        ALGORITHM_WORDING["blt"], UNIT_WORDING["example"], _PER_EXAMPLE, _MICROBATCH
    ),
    ("dp-fedavg", "user"): _federated_variant("dp-fedavg"),
    ("dp-fedsgd", "user"): _federated_variant("dp-fedsgd"),
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
    "shuffle": SamplerWording(
        "NOT met: batches were shuffled fixed-size batches (one pass per epoch), but ε is "
        "computed as if they were Poisson-sampled at q = B/N. ε under the Poisson assumption = "
        "{eps}; the honest ε for shuffled batches is not known (guide §4.3).",
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
        run_charges,
    )

    if plan.mechanism not in CORRELATED_MECHANISMS:
        return {}
    charges = run_charges(
        plan.mechanism,
        plan.strategy,
        plan.sampler,
        plan.steps,
        plan.dataset_size,
        plan.expected_batch_size,
    )
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
    """The phrases for ``plan``: its algorithm at its unit of privacy, and its sampler."""
    known("algorithm", plan.algorithm, ALGORITHM_WORDING)
    unit_wording(plan.unit)
    variant = VARIANT_WORDING.get((plan.algorithm, plan.unit))
    if variant is None:
        worded = ", ".join(f"{a} at the {u} level" for a, u in VARIANT_WORDING)
        raise ValueError(
            f"the report has no wording for {plan.algorithm} at the {plan.unit} level; it words "
            f"{worded}"
        )
    return Wording(variant, sampler_wording(plan.sampler))


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
