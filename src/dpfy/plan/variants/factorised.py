"""Matrix-factorisation noise: BandMF (Choquette-Choo et al. 2023; McKenna 2024) and BLT
(Dvijotham, McMahan et al. 2024), over the only batches their accounting covers.

Batches in one order fixed before training and repeated every epoch (min-separation
participation, zero-out), or for BandMF cyclic Poisson groups (amplified BandMF, add-or-remove).
The strategy is optimised when the plan is made (:mod:`dpfy.plan.correlated`) and stored in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dpfy._validate import check_count
from dpfy.plan.accounting.events import NeighbouringRelation
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
from dpfy.plan.sampling import ORDERS, SamplingKind, SamplingRecord
from dpfy.plan.variants.registry import Resolver, TrainingVariant, register_variant
from dpfy.plan.variants.request import (
    PlanRequest,
    calibrated,
    plan_from,
    refuse_unsupported,
    total_steps,
)
from dpfy.plan.variants.text import (
    AlgorithmText,
    central_gradients,
)

__all__ = ["CYCLIC_BATCHES_PER_GROUP", "DEFAULT_BANDS", "DEFAULT_BUFFERS"]


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
        refuse_unsupported(
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
        steps = total_steps(request, per_epoch)
        made = design(request, kind, steps, per_epoch)
        # Calibrated on exactly the events the ledger will record (its charges): their
        # composition is correlated_accounting's event, and no discretisation difference
        # between the two can make the guard refuse the run's last charge.
        sigma = calibrated(request, made.charges.run_events, made.relation, request.accountant)
        return plan_from(
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


def _factorised_accounting(name: str) -> str:
    """Matrix-factorisation noise (dpfy.plan.correlated_events), accounted by participation."""
    return (
        f"{name} matrix-factorisation noise, accounted with the {{accountant}} accountant: step t "
        "adds σ·sensitivity·(C⁻¹z)_t to its clipped sum, z fresh N(0, I) every step "
        "(σ = {sigma:.6g}), so the noise is correlated across steps and partly cancels in the "
        "running sum. Strategy C: {strategy}, optimised for this run's {planned} steps and its "
        "participation when the run was planned. {charged}"
    )


def _text(name: str, full: str) -> AlgorithmText:
    """A matrix-factorisation algorithm's words: central DP over the noised gradients."""
    return central_gradients(full, _factorised_accounting(name))


register_variant(
    TrainingVariant(
        "bandmf",
        "example",
        "BandMF",
        _factorised("bandmf", "banded-mf", "BandMF", "bands", _banded),
        _text(
            "BandMF (banded)",
            "BandMF (banded matrix factorisation, Choquette-Choo et al. 2023; McKenna 2024)",
        ),
        "factorised",
    )
)
register_variant(
    TrainingVariant(
        "blt",
        "example",
        "BLT",
        _factorised("blt", "blt", "BLT", "buffers", _blt),
        _text(
            "BLT (buffered linear Toeplitz)",
            "BLT (buffered linear Toeplitz matrix factorisation, Dvijotham, McMahan et al. 2024)",
        ),
        "factorised",
    )
)
