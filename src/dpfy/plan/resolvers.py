"""From what the user asked for to the privacy plan: one small resolver per algorithm and unit.

A resolver fixes everything privacy-relevant before the first step — the steps, the sampling
record the sampler must then report, the neighbouring relation, the accountant, the noise
mechanism and σ (calibrated on exactly the events the ledger will record). Resolvers register
under (algorithm, clipping unit); :func:`make_plan` looks one up, so adding a mechanism means
adding a resolver, not another branch in the builder. Torch-free: plans can be made and checked
anywhere (the CLI's ``plan`` command, a report, a test).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting.calibrate import smallest_noise_multiplier
from dpfy.plan.accounting.events import DpEvent, NeighbouringRelation, SelfComposedEvent
from dpfy.plan.correlated.banded import optimise_banded
from dpfy.plan.correlated.blt import Blt, optimise_blt
from dpfy.plan.correlated.participation import CyclicPoisson
from dpfy.plan.correlated_events import (
    Charges,
    Strategy,
    cyclic_charges,
    encode_strategy,
    epoch_charges,
    epoch_participation,
)
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import ORDERS, SamplingKind, SamplingRecord, parse_order
from dpfy.plan.tree_events import check_tree, ftrl_step_events, resolve_restart

__all__ = ["PlanRequest", "make_plan", "register_resolver", "resolver_key", "resolver_keys"]


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for, already checked for type and range by the builder.

    ``records`` and ``batch_size`` count what is sampled: examples, or users at user level
    (``examples`` is then the number of examples they hold). ``sampler``, ``restart_every``,
    ``tree``, ``bands`` and ``buffers`` are None when the user left them to the algorithm.
    """

    records: int
    batch_size: int
    delta: float
    max_grad_norm: float
    epochs: float | None = None
    steps: int | None = None
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    accountant: str = "pld"
    sampler: SamplingKind | str | None = None
    microbatch_size: int | None = None
    loss_reduction: str = "mean"
    seeded: bool = False
    world_size: int = 1
    examples: int | None = None
    max_examples_per_user: int | None = None
    restart_every: int | str | None = None
    tree: str | None = None
    bands: int | None = None
    buffers: int | None = None


Resolver = Callable[[PlanRequest], PrivacyPlan]
_RESOLVERS: dict[tuple[str, str], Resolver] = {}


def register_resolver(algorithm: str, unit: str) -> Callable[[Resolver], Resolver]:
    """Register the resolver of ``algorithm`` at sampling unit ``unit`` ('example' or 'user')."""

    def register(resolver: Resolver) -> Resolver:
        _RESOLVERS[(algorithm, unit)] = resolver
        return resolver

    return register


def resolver_keys() -> tuple[tuple[str, str], ...]:
    """Every (algorithm, unit) a plan can be made for."""
    return tuple(_RESOLVERS)


def resolver_key(algorithm: str, unit: str) -> tuple[str, str]:
    """(algorithm, unit) normalised, after refusing a pair no resolver plans, with the choices."""
    key = (str(algorithm).strip().lower(), unit)
    if key not in _RESOLVERS:
        known = ", ".join(sorted({name for name, _ in _RESOLVERS}))
        units = sorted(u for name, u in _RESOLVERS if name == key[0])
        if units:
            raise ValueError(
                f"{key[0]} is available at the {' and '.join(units)} level, not per {unit}; "
                f"{'drop user_ids' if unit == 'user' else 'pass user_ids'} or choose another "
                "algorithm"
            )
        raise ValueError(f"algorithm must be one of {known}; got {algorithm!r}")
    return key


def make_plan(
    request: PlanRequest, algorithm: str = "dp-sgd", unit: str = "example"
) -> PrivacyPlan:
    """The plan for ``request`` from the resolver of (``algorithm``, ``unit``)."""
    return _RESOLVERS[resolver_key(algorithm, unit)](request)


def _calibrated(
    request: PlanRequest,
    run_events: Callable[[float], DpEvent],
    relation: NeighbouringRelation,
    accountant: str,
) -> float:
    """σ as given, or the smallest σ whose run (``run_events(σ)``) meets the target ε."""
    if (request.target_epsilon is None) == (request.noise_multiplier is None):
        raise ValueError(
            "give exactly one of target_epsilon= (σ is calibrated) or noise_multiplier="
        )
    if request.noise_multiplier is not None:
        return check_positive("noise_multiplier", request.noise_multiplier)
    return smallest_noise_multiplier(
        run_events,
        check_positive("target_epsilon", request.target_epsilon),
        request.delta,
        accountant=accountant,
        relation=relation,
    )


def _steps(request: PlanRequest, per_epoch: float) -> int:
    """Total steps from exactly one of epochs (⌈E · steps per epoch⌉) and steps."""
    if (request.epochs is None) == (request.steps is None):
        raise ValueError("give exactly one of epochs= or steps=")
    if request.steps is not None:
        return check_count("steps", request.steps, minimum=1)
    return max(1, math.ceil(check_positive("epochs", request.epochs) * per_epoch))


def _refuse(request: PlanRequest, what: str, **unsupported: object) -> None:
    """One error naming every option this variant cannot honour (set away from its default)."""
    given = [name for name, value in unsupported.items() if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} not supported with {what}; leave "
            f"{'them' if len(given) > 1 else 'it'} at the default"
        )


def _plan(
    request: PlanRequest,
    record: SamplingRecord,
    steps: int,
    sigma: float,
    relation: NeighbouringRelation,
    accountant: str,
    **variant: object,
) -> PrivacyPlan:
    """The plan's common fields from the request and the resolved sampling, steps and σ."""
    return PrivacyPlan(
        dataset_size=request.records,
        expected_batch_size=request.batch_size,
        sampling_rate=record.sampling_rate,
        steps=steps,
        noise_multiplier=sigma,
        max_grad_norm=request.max_grad_norm,
        delta=request.delta,
        target_epsilon=request.target_epsilon,
        accountant=accountant,
        sampler=record.kind.value,
        microbatch_size=request.microbatch_size,
        loss_reduction=request.loss_reduction,
        seeded=request.seeded,
        world_size=request.world_size,
        relation=relation.value,
        **variant,  # type: ignore[arg-type]
    )


@register_resolver("dp-sgd", "example")
def _dp_sgd(request: PlanRequest) -> PrivacyPlan:
    """DP-SGD (guide alg. 1): Poisson unless another sampler is chosen (fixed-size: replace-one)."""
    _refuse(
        request,
        "DP-SGD",
        restart_every=request.restart_every,
        tree=request.tree,
        bands=request.bands,
        buffers=request.buffers,
    )
    kind = SamplingKind.parse(SamplingKind.POISSON if request.sampler is None else request.sampler)
    if kind not in (SamplingKind.POISSON, SamplingKind.SHUFFLE, SamplingKind.FIXED_SIZE):
        raise ValueError(
            f"DP-SGD samples by 'poisson', 'shuffle' or 'fixed-size', got {kind.value!r} (the "
            "tree orders belong to algorithm='dp-ftrl')"
        )
    if request.microbatch_size is not None:
        check_count("microbatch_size", request.microbatch_size, minimum=1)
    relation, accountant = NeighbouringRelation.ADD_OR_REMOVE, request.accountant
    if kind is SamplingKind.FIXED_SIZE:  # its sound bounds hold under replace-one only
        relation, accountant = NeighbouringRelation.REPLACE_ONE, "rdp"
    record = SamplingRecord(
        kind,
        request.batch_size / request.records,
        request.records,
        None if kind is SamplingKind.POISSON else request.batch_size,
    )
    steps = _steps(request, request.records / request.batch_size)
    sigma = _calibrated(
        request, lambda s: SelfComposedEvent(record.event(s), steps), relation, accountant
    )
    return _plan(request, record, steps, sigma, relation, accountant)


@register_resolver("dp-sgd", "user")
def _user_dp_sgd(request: PlanRequest) -> PrivacyPlan:
    """User-level DP-SGD (McMahan et al. 2018): Poisson-sampled users, each user's mean clipped."""
    poisson = request.sampler is None or SamplingKind.parse(request.sampler) is SamplingKind.POISSON
    _refuse(
        request,
        "user_ids (user-level DP-SGD samples users by Poisson and clips per user)",
        microbatch_size=request.microbatch_size,
        sampler=None if poisson else request.sampler,
        restart_every=request.restart_every,
        tree=request.tree,
        bands=request.bands,
        buffers=request.buffers,
    )
    cap = request.max_examples_per_user
    if cap is not None:
        cap = check_count("max_examples_per_user", cap, minimum=1)
    relation = NeighbouringRelation.ADD_OR_REMOVE
    record = SamplingRecord(
        SamplingKind.POISSON, request.batch_size / request.records, request.records, unit="user"
    )
    steps = _steps(request, request.records / request.batch_size)
    sigma = _calibrated(
        request, lambda s: SelfComposedEvent(record.event(s), steps), relation, request.accountant
    )
    return _plan(
        request,
        record,
        steps,
        sigma,
        relation,
        request.accountant,
        unit="user",
        examples=request.examples,
        max_examples_per_user=cap,
    )


def _federated(algorithm: str) -> Resolver:
    """DP-FedAvg / DP-FedSGD (guide alg. 2): user-level DP-SGD's plan, each round one step."""

    def resolve(request: PlanRequest) -> PrivacyPlan:
        return dataclasses.replace(_user_dp_sgd(request), algorithm=algorithm)

    resolve.__doc__ = f"{algorithm}: Poisson-sampled users, each user's model change clipped."
    return resolve


for _name in ("dp-fedavg", "dp-fedsgd"):
    register_resolver(_name, "user")(_federated(_name))


@register_resolver("dp-ftrl", "example")
def _dp_ftrl(request: PlanRequest) -> PrivacyPlan:
    """DP-FTRL (Kairouz et al. 2021): batches in order, tree-aggregated noise, zero-out relation."""
    _refuse(request, "DP-FTRL", bands=request.bands, buffers=request.buffers)
    kind = parse_order(request.sampler)
    per_epoch = request.records // request.batch_size
    k = resolve_restart(request.restart_every, per_epoch)
    tree = check_tree("efficient" if request.tree is None else str(request.tree))
    relation = NeighbouringRelation.ZERO_OUT  # the stream's order is kept (App. D)
    record = SamplingRecord(
        kind, request.batch_size / request.records, request.records, request.batch_size
    )
    steps = _steps(request, per_epoch)
    sigma = _calibrated(
        request,
        lambda s: ftrl_step_events(s, steps, per_epoch, k),
        relation,
        request.accountant,
    )
    return _plan(
        request,
        record,
        steps,
        sigma,
        relation,
        request.accountant,
        algorithm="dp-ftrl",
        mechanism="tree-aggregation",
        restart_every=k,
        tree=tree,
    )


#: BandMF's default bands, capped at the steps of an epoch (then the columns one example can
#: touch are disjoint and its sensitivity is exact). BandMF keeps bands − 1 noise tensors per
#: parameter, and beyond 16 each band buys less (docs/correlated-noise.md). BLT keeps 4
#: running sums per parameter by default.
DEFAULT_BANDS = 16
DEFAULT_BUFFERS = 4
#: Amplified BandMF's default groups (= bands) leave about this many batches to each group:
#: amplification needs q = bands·B/N well below 1, and in the measurements of
#: docs/correlated-noise.md the best bands were near N // B / 8 (at most 16).
CYCLIC_BATCHES_PER_GROUP = 8

_FIXED_ORDER_NAMES = ("fixed-order", SamplingKind.FIXED_ORDER_EPOCHS.value)


def _batch_order(request: PlanRequest, name: str, cyclic: bool) -> SamplingKind:
    """One order fixed before training and kept every epoch (the default), or for BandMF
    (``cyclic``) cyclic Poisson groups: the only batches matrix-factorisation noise accounts."""
    if request.sampler is None:
        return SamplingKind.FIXED_ORDER_EPOCHS
    sampler = request.sampler
    value = sampler.value if isinstance(sampler, SamplingKind) else str(sampler).strip().lower()
    if value in _FIXED_ORDER_NAMES:
        return SamplingKind.FIXED_ORDER_EPOCHS
    if cyclic and value == SamplingKind.CYCLIC_POISSON.value:
        return SamplingKind.CYCLIC_POISSON
    fresh = "a fresh shuffle every epoch" if value in ORDERS else "sampling"
    amplified = " or sampler='cyclic-poisson' (amplified BandMF)" if cyclic else ""
    raise ValueError(
        f"{name} takes the batches in one order fixed before training and repeated every epoch "
        f"(sampler='fixed-order', the default){amplified}: its accounting needs each example "
        f"exactly N // B steps apart, which sampler={value!r} ({fresh}) does not keep; leave "
        "sampler unset, or train with DP-SGD (Poisson) or DP-FTRL (shuffled epochs)"
    )


def _bands(request: PlanRequest, steps: int, per_epoch: int, cyclic: bool) -> int:
    """BandMF's bands: as asked, else min(16, steps per epoch, steps); amplified (``cyclic``),
    min(16, ⌊N // B / 8⌋, steps) at least 1, so each group is about 8 batches (q ≤ 1/8)."""
    share = max(1, per_epoch // CYCLIC_BATCHES_PER_GROUP) if cyclic else per_epoch
    bands = min(DEFAULT_BANDS, share, steps) if request.bands is None else request.bands
    bands = check_count("bands", bands, minimum=1)
    if bands > steps:
        raise ValueError(
            f"bands={bands} exceeds the run's {steps} steps (C is steps × steps); lower bands"
        )
    return bands


@dataclass(frozen=True)
class _Factorised:
    """What a matrix-factorisation resolver fixes besides σ: strategy, charges, batches."""

    strategy: Strategy
    charges: Charges
    record: SamplingRecord
    relation: NeighbouringRelation


def _banded(request: PlanRequest, kind: SamplingKind, steps: int, per_epoch: int) -> _Factorised:
    """BandMF: ``bands`` optimised for min-separated epochs, or for ``bands`` cyclic Poisson
    groups sampled at q = bands·B/N (amplified BandMF, add-or-remove)."""
    cyclic = kind is SamplingKind.CYCLIC_POISSON
    bands = _bands(request, steps, per_epoch, cyclic)
    if cyclic:
        rate = bands * request.batch_size / request.records  # ≤ 1: bands ≤ N // B
        if rate > 1.0:
            raise ValueError(
                f"amplified BandMF splits the data into as many groups as bands ({bands}), each "
                f"of about N/bands = {request.records / bands:.4g} examples, fewer than the "
                f"batch size {request.batch_size}: lower bands to at most N // B = {per_epoch}"
            )
        strategy = optimise_banded(steps, bands, CyclicPoisson(bands, rate))
        record = SamplingRecord(kind, rate, request.records)
        charges: Charges = cyclic_charges(strategy, steps, bands, rate)
        return _Factorised(strategy, charges, record, NeighbouringRelation.ADD_OR_REMOVE)
    strategy = optimise_banded(steps, bands, epoch_participation(steps, per_epoch))
    return _in_order(request, kind, strategy, steps, per_epoch)


def _blt(request: PlanRequest, kind: SamplingKind, steps: int, per_epoch: int) -> _Factorised:
    """BLT: ``buffers`` (default 4) optimised for min-separated epochs; one step needs none."""
    buffers = DEFAULT_BUFFERS if request.buffers is None else request.buffers
    buffers = check_count("buffers", buffers, minimum=1)
    if steps < 2:  # one step: every strategy is DP-SGD's
        strategy: Strategy = Blt((), ())
    else:
        strategy = optimise_blt(steps, buffers, epoch_participation(steps, per_epoch))
    return _in_order(request, kind, strategy, steps, per_epoch)


def _in_order(
    request: PlanRequest, kind: SamplingKind, strategy: Strategy, steps: int, per_epoch: int
) -> _Factorised:
    """Batches in one repeated order: charged by epoch, zero-out (the order is fixed)."""
    record = SamplingRecord(
        kind, request.batch_size / request.records, request.records, request.batch_size
    )
    charges = epoch_charges(strategy, steps, per_epoch)
    return _Factorised(strategy, charges, record, NeighbouringRelation.ZERO_OUT)


def _factorised(
    algorithm: str,
    mechanism: str,
    name: str,
    size: str,
    design: Callable[[PlanRequest, SamplingKind, int, int], _Factorised],
) -> Resolver:
    """A matrix-factorisation variant: its batches, its strategy optimised, σ calibrated."""

    def resolve(request: PlanRequest) -> PrivacyPlan:
        other = "buffers" if size == "bands" else "bands"
        _refuse(
            request,
            name,
            restart_every=request.restart_every,
            tree=request.tree,
            **{other: getattr(request, other)},
        )
        kind = _batch_order(request, name, cyclic=mechanism == "banded-mf")
        if request.microbatch_size is not None:
            check_count("microbatch_size", request.microbatch_size, minimum=1)
        per_epoch = request.records // request.batch_size
        steps = _steps(request, per_epoch)
        made = design(request, kind, steps, per_epoch)
        # Calibrated on exactly the events the ledger will record (its charges): their
        # composition is correlated_accounting's event, and no discretisation difference
        # between the two can make the guard refuse the run's last charge.
        sigma = _calibrated(request, made.charges.run_events, made.relation, request.accountant)
        return _plan(
            request,
            made.record,
            steps,
            sigma,
            made.relation,
            request.accountant,
            algorithm=algorithm,
            mechanism=mechanism,
            strategy=encode_strategy(made.strategy),
        )

    resolve.__doc__ = f"{name}: matrix-factorisation noise over batches its accounting covers."
    return resolve


_bandmf = _factorised("bandmf", "banded-mf", "BandMF", "bands", _banded)
register_resolver("bandmf", "example")(_bandmf)
register_resolver("blt", "example")(_factorised("blt", "blt", "BLT", "buffers", _blt))
