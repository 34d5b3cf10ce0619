"""The wording registry: each algorithm, unit and sampler words its own sentences, or is refused."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

from dpfy.plan.accounting.events import GaussianEvent
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SAMPLING_UNITS, SamplingKind, SamplingRecord
from dpfy.report.diagnostics import render_diagnostics
from dpfy.report.facts import (
    UNITS,
    DatasetFacts,
    ModelFacts,
    RunFacts,
    TrainingFacts,
    accounting_facts,
)
from dpfy.report.render import build_report
from dpfy.report.wording import (
    ALGORITHM_WORDING,
    SAMPLER_WORDING,
    UNIT_WORDING,
    VARIANT_WORDING,
    wording_for,
)
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.step_record import StepRecord

N, B, DELTA = 1_000, 50, 1e-5


def plan(**changes) -> PrivacyPlan:
    base = PrivacyPlan(N, B, B / N, 4, 1.0, 1.0, DELTA, None, "pld", "poisson", None, "mean")
    if changes.get("sampler") in RELATIONS:
        changes = {"relation": RELATIONS[changes["sampler"]], **changes}
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"algorithm": "dp-foo"}, "no wording for algorithm 'dp-foo'; it words dp-sgd, dp-ftrl"),
        ({"unit": "group"}, "no wording for unit of privacy 'group'; it words example, user"),
        ({"algorithm": "dp-ftrl", "unit": "user"}, "no wording for dp-ftrl at the user level"),
        ({"algorithm": "dp-fedavg"}, "no wording for dp-fedavg at the example level"),
        ({"sampler": "lottery"}, "no wording for sampler 'lottery'"),
    ],
)
def test_a_name_without_wording_is_one_clear_error(changes, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        wording_for(plan(**changes))


# The relation each sampler's steps are accounted under (DESIGN rule 7).
RELATIONS = {
    "fixed-size": "replace-one",
    "tree-shuffle": "zero-out",
    "tree-fixed-order": "zero-out",
    "fixed-order-epochs": "zero-out",
}


def _facts(privacy: PrivacyPlan, unit: str = "example") -> RunFacts:
    """Facts of four steps of ``privacy``'s sampler, accounted with RDP (it bounds them all)."""
    kind = SamplingKind(privacy.sampler)
    relation = RELATIONS.get(kind.value, "add-or-remove")
    tree = kind.value.startswith("tree")
    record = SamplingRecord(
        kind, B / N, N, None if kind is SamplingKind.POISSON else B, unit=privacy.unit,
        tree_nodes=int(tree),
    )  # fmt: skip
    book = PrivacyLedger(DELTA, relation=relation, accountant="rdp")
    # Batches in one repeated order carry no event: their mechanism charges each step.
    charged = (
        GaussianEvent(privacy.noise_multiplier) if kind is SamplingKind.FIXED_ORDER_EPOCHS else None
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shuffled batches warn that they are not Poisson
        for _ in range(4):
            book.record(StepRecord(record, privacy.noise_multiplier, charged=charged))
    return RunFacts(
        dataset=DatasetFacts("d", privacy.examples or N),
        model=ModelFacts("m", 10, 10, 0),
        privacy=dataclasses.replace(privacy, accountant="rdp", relation=relation),
        training=TrainingFacts("SGD", 0.1, 4, 4 * B / N, unit=unit),
        accounting=accounting_facts(book),
        software={},
    )


def test_unknown_algorithm_is_refused_by_the_report_and_by_saved_facts():
    facts = _facts(plan())
    foreign = dataclasses.replace(facts, privacy=dataclasses.replace(facts.privacy, algorithm="x"))
    with pytest.raises(ValueError, match="no wording for algorithm 'x'"):
        build_report(foreign)
    data = dataclasses.replace(
        facts, privacy=dataclasses.replace(facts.privacy, algorithm="dp-ftrl", unit="user")
    ).to_dict()
    with pytest.raises(ValueError, match="privacy: the report has no wording for dp-ftrl at the"):
        RunFacts.from_dict(data)


def test_the_registries_cover_every_name_the_plan_and_facts_can_hold():
    assert set(SAMPLER_WORDING) == {kind.value for kind in SamplingKind}
    assert set(UNIT_WORDING) == set(UNITS) == set(SAMPLING_UNITS)
    for algorithm, unit in VARIANT_WORDING:
        assert VARIANT_WORDING[algorithm, unit].algorithm is ALGORITHM_WORDING[algorithm]
        assert VARIANT_WORDING[algorithm, unit].unit is UNIT_WORDING[unit]
    assert {a for a, _ in VARIANT_WORDING} == set(ALGORITHM_WORDING)


VARIANTS = {
    "dp-sgd, example, poisson": ({}, "via DP-SGD", "q (sampling rate)"),
    "dp-sgd, example, microbatches": ({"microbatch_size": 5}, "sensitivity 2C = 2", "per-micro"),
    "dp-sgd, example, shuffle": ({"sampler": "shuffle"}, "NOT met", "did NOT meet"),
    "dp-sgd, example, fixed-size": ({"sampler": "fixed-size"}, "replace-one", "fixed-size sub"),
    "dp-sgd, user": (
        {"unit": "user", "examples": 5_000, "max_examples_per_user": 3},
        "each sampled user's mean gradient is clipped",
        "at most 3 of their examples",
    ),
    "dp-ftrl, tree-shuffle": (
        {
            "algorithm": "dp-ftrl",
            "sampler": "tree-shuffle",
            "mechanism": "tree-aggregation",
            "restart_every": 20,
            "tree": "efficient",
        },
        "taken in a shuffled order",
        "B/N (batch fraction; nothing is sampled)",
    ),
    "dp-ftrl, tree-fixed-order": (
        {
            "algorithm": "dp-ftrl",
            "sampler": "tree-fixed-order",
            "mechanism": "tree-aggregation",
            "restart_every": 20,
            "tree": "efficient",
        },
        "NO sampling assumption",
        "taken in a fixed order",
    ),
    "bandmf": (
        {
            "algorithm": "bandmf",
            "sampler": "fixed-order-epochs",
            "mechanism": "banded-mf",
            "strategy": (1.0, 0.5, 0.25),
        },
        "BandMF (banded) matrix-factorisation noise",
        "BandMF, 3 bands (coefficients 1, c_1, …: 1, 0.5, 0.25)",
    ),
    "blt, microbatches": (
        {
            "algorithm": "blt",
            "sampler": "fixed-order-epochs",
            "mechanism": "blt",
            "strategy": (0.5, 0.9, 0.3, 0.2),
            "microbatch_size": 5,
        },
        "BLT, 2 buffers (decays, then weights: 0.5, 0.9, 0.3, 0.2)",
        "each example in at most k = 1 step (one per epoch), exactly s = 20 steps apart",
    ),
    "dp-fedavg": (
        {"algorithm": "dp-fedavg", "unit": "user", "examples": 5_000},
        "via DP-FedAvg",
        "model change after local training",
    ),
    "dp-fedsgd": (
        {"algorithm": "dp-fedsgd", "unit": "user", "examples": 5_000},
        "trusted aggregator",
        "(DP-FedSGD, guide alg. 2",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_renders_its_own_sentences_with_every_field_filled(variant):
    changes, *phrases = VARIANTS[variant]
    privacy = plan(**changes)
    facts = _facts(privacy, unit=privacy.unit)
    card = build_report(facts)
    md = card.to_markdown()
    diagnostics = render_diagnostics(facts)  # names the clipped unit beside its norms
    for phrase in phrases:
        assert phrase in md + diagnostics, phrase
    for text in (md, diagnostics):
        assert not re.search(r"\{[a-z_]*(:[^}]*)?\}", text), "a template field was left unfilled"
    user_level = privacy.unit == "user"
    assert ("one user (all of that user's examples)" in md) is user_level
    assert ("| users | N |" in md) is user_level
