"""Each pitfall detector fires on facts showing its pitfall and stays quiet on facts without it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from torch import nn

from dpfy.plan.accounting import dpsgd_event
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.report.facts import (
    DatasetFacts,
    GradNormStats,
    PreprocessingStep,
    RunFacts,
    TrainingFacts,
    TuningFacts,
    accounting_facts,
    model_facts,
)
from dpfy.report.pitfalls import (
    DETECTORS,
    READS_DIAGNOSTICS,
    Finding,
    Severity,
    detector,
    diagnostic_pitfalls,
    find_pitfalls,
)
from dpfy.train.checks import find_sparse_gradient_layers
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.step_record import StepRecord

N, B, SIGMA, C, DELTA, STEPS = 10_000, 100, 1.0, 1.0, 1e-6, 50


def ledger(*, tuning: bool = False) -> PrivacyLedger:
    """A Poisson run of STEPS steps, optionally with a recorded tuning event."""
    book = PrivacyLedger(DELTA)
    record = SamplingRecord(SamplingKind.POISSON, B / N, N)
    for _ in range(STEPS):
        book.record(StepRecord(record, SIGMA))
    if tuning:
        book.record_event(dpsgd_event(B / N, SIGMA, 100), label="tuning")
    return book


@pytest.fixture(scope="module")
def clean() -> RunFacts:
    """Facts of a run with no pitfall: Poisson, small δ, C near the median norm, no tuning."""
    return RunFacts(
        dataset=DatasetFacts("synthetic", N),
        model=model_facts(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), "mlp"),
        privacy=PrivacyPlan(
            N, B, B / N, STEPS, SIGMA, C, DELTA, None, "pld", "poisson", None, "mean"
        ),
        training=TrainingFacts("SGD", 0.1, STEPS, STEPS * B / N),
        accounting=accounting_facts(ledger()),
        software={},
        grad_norms=GradNormStats.from_norms(np.linspace(0.5, 1.5, 101), C),
    )


@pytest.fixture(scope="module")
def tuned_ledger_facts() -> object:
    return accounting_facts(ledger(tuning=True))


def codes(facts: RunFacts) -> list[str]:
    return [f.code for f in find_pitfalls(facts)]


def with_privacy(facts: RunFacts, **changes) -> RunFacts:
    return dataclasses.replace(facts, privacy=dataclasses.replace(facts.privacy, **changes))


def with_training(facts: RunFacts, **changes) -> RunFacts:
    return dataclasses.replace(facts, training=dataclasses.replace(facts.training, **changes))


def only(facts: RunFacts, code: str) -> Finding:
    (finding,) = [f for f in find_pitfalls(facts) if f.code == code]
    return finding


def test_a_clean_run_has_no_findings(clean):
    assert find_pitfalls(clean) == ()


def test_a_seeded_run_is_flagged_because_its_noise_can_be_replayed(clean):
    finding = only(with_privacy(clean, seeded=True), "seeded-randomness")
    assert finding.severity is Severity.WARNING  # an experiment: --strict makes it fail
    assert "seed stays secret" in finding.evidence and "OS entropy" in finding.fix
    assert "seeded-randomness" not in codes(clean)


# -- batch-coupled layers (model checks reused) ---------------------------------------------------


def test_batch_coupled_layers_found_through_the_model_checks(clean):
    model = model_facts(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), "bn-mlp")
    finding = only(dataclasses.replace(clean, model=model), "batch-coupled-layer")
    assert finding.severity is Severity.ERROR and "1 (BatchNorm1d)" in finding.title
    assert "dpfy.fix" in finding.fix and finding.guide_section == "§5.5.1"
    assert "batch-coupled-layer" not in codes(clean)


# -- sampling -------------------------------------------------------------------------------------


def test_shuffled_sampling_is_an_error_that_cites_the_poisson_epsilon(clean):
    finding = only(with_privacy(clean, sampler="shuffle"), "sampling-not-poisson")
    assert finding.severity is Severity.ERROR
    assert f"{clean.accounting.summary.total_epsilon:.4g} assumes Poisson" in finding.evidence
    assert "no ε is known for shuffling" in finding.evidence


def test_fixed_size_sampling_warns_about_replace_one(clean):
    finding = only(with_privacy(clean, sampler="fixed-size"), "sampling-not-poisson")
    assert finding.severity is Severity.WARNING and "replace-one" in finding.evidence


def test_poisson_sampling_is_not_flagged(clean):
    assert "sampling-not-poisson" not in codes(clean)


# -- δ --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [1 / N, 2 / N, 0.5])
def test_delta_at_or_above_one_over_n_is_an_error(clean, delta):
    finding = only(with_privacy(clean, delta=delta), "delta-too-large")
    assert finding.severity is Severity.ERROR and "1/N = 0.0001" in finding.evidence
    assert "δ ≤ 1e-05" in finding.fix


def test_delta_below_one_over_n_passes(clean):
    assert "delta-too-large" not in codes(with_privacy(clean, delta=0.99 / N))


# -- unit of privacy ------------------------------------------------------------------------------


def test_user_level_claim_from_example_sampling_warns(clean):
    finding = only(with_training(clean, unit="user"), "user-level-claim")
    assert (
        finding.severity is Severity.WARNING
        and "poisson sampling over N = 10000" in finding.evidence
    )
    assert "user-level-claim" not in codes(clean)


# -- preprocessing --------------------------------------------------------------------------------


def _with_steps(facts: RunFacts, *steps: PreprocessingStep) -> RunFacts:
    return dataclasses.replace(
        facts, dataset=dataclasses.replace(facts.dataset, preprocessing=steps)
    )


def test_preprocessing_fitted_on_private_data_is_an_error(clean):
    facts = _with_steps(clean, PreprocessingStep("vocabulary", "WordPiece vocabulary", True))
    finding = only(facts, "preprocessing-fitted-on-private-data")
    assert finding.severity is Severity.ERROR and "'vocabulary'" in finding.title
    assert "WordPiece vocabulary" in finding.evidence


@pytest.mark.parametrize(
    "step",
    [
        PreprocessingStep("standardise", "public statistics", True, declared_public=True),
        PreprocessingStep("scale to [0, 1]", "fixed constants", False),
    ],
)
def test_public_or_fixed_preprocessing_passes(clean, step):
    assert "preprocessing-fitted-on-private-data" not in codes(_with_steps(clean, step))


# -- sequence loss normalisation ------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["sum", "per-sequence-sum"])
def test_sequence_loss_without_length_normalisation_warns(clean, norm):
    facts = with_training(clean, sequence_task=True, loss_normalisation=norm)
    finding = only(facts, "sequence-loss-not-normalised")
    assert finding.severity is Severity.WARNING and f"'{norm}'" in finding.evidence
    assert "target tokens" in finding.fix


def test_undeclared_sequence_loss_normalisation_warns(clean):
    finding = only(with_training(clean, sequence_task=True), "sequence-loss-not-normalised")
    assert "not declared" in finding.title


@pytest.mark.parametrize(
    ("sequence", "norm"), [(True, "per-token-mean"), (True, "per-example-mean"), (False, "sum")]
)
def test_normalised_or_non_sequence_losses_pass(clean, sequence, norm):
    facts = with_training(clean, sequence_task=sequence, loss_normalisation=norm)
    assert "sequence-loss-not-normalised" not in codes(facts)


def test_unknown_loss_normalisation_is_refused(clean):
    with pytest.raises(ValueError, match="loss_normalisation must be one of"):
        with_training(clean, loss_normalisation="mean-ish")


# -- frozen, unnoised and sparse parameters -------------------------------------------------------


def test_frozen_parameters_are_stated_as_untrained_and_public(clean):
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[0].requires_grad_(False)
    finding = only(dataclasses.replace(clean, model=model_facts(net, "m")), "frozen-parameters")
    assert finding.severity is Severity.INFO and "(20 values)" in finding.title
    assert "0.weight, 0.bias" in finding.evidence and "public" in finding.fix
    assert "frozen-parameters" not in codes(clean)


def test_trainable_parameters_the_engine_does_not_noise_are_an_error(clean):
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    facts = dataclasses.replace(clean, model=model_facts(net, "m", noised=["0.weight", "0.bias"]))
    finding = only(facts, "unnoised-parameters")
    assert finding.severity is Severity.ERROR and "1.weight, 1.bias" in finding.evidence
    assert "unnoised-parameters" not in codes(clean)


def test_sparse_embeddings_are_noted_as_densely_noised(clean):
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    finding = only(dataclasses.replace(clean, model=model_facts(net, "m")), "sparse-gradients")
    assert finding.severity is Severity.INFO and "every coordinate" in finding.evidence


def test_dense_embeddings_are_not_sparse():
    assert find_sparse_gradient_layers(nn.Embedding(10, 4)) == ()
    bag = nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True))
    assert [(f.path, f.layer) for f in find_sparse_gradient_layers(bag)] == [("0", "EmbeddingBag")]


# -- clip norm against the gradient norms ---------------------------------------------------------


def _with_norms(facts: RunFacts, clip: float, median: float = 1.0) -> RunFacts:
    norms = np.linspace(0.5, 1.5, 101) * median
    return dataclasses.replace(facts, grad_norms=GradNormStats.from_norms(norms, clip))


def test_clip_norm_far_above_the_median_warns_noise_swamps_signal(clean):
    finding = only(_with_norms(clean, clip=6.0), "clip-norm-too-large")
    assert finding.severity is Severity.WARNING and "C = 6 × median" in finding.evidence
    assert "0% of 101" in finding.evidence and "ClipSearch" in finding.fix


def test_clip_norm_far_below_the_median_warns_information_lost(clean):
    finding = only(_with_norms(clean, clip=0.09), "clip-norm-too-small")
    assert "100% of 101" in finding.evidence


@pytest.mark.parametrize("clip", [0.11, 1.0, 4.9])
def test_clip_norm_near_the_median_passes(clean, clip):
    assert not {"clip-norm-too-large", "clip-norm-too-small"} & set(codes(_with_norms(clean, clip)))


def test_the_clip_norm_check_reads_diagnostics_so_its_finding_stays_off_the_card(clean):
    facts = _with_norms(clean, clip=6.0)
    assert "clip-norm-mismatch" in READS_DIAGNOSTICS
    assert [f.code for f in diagnostic_pitfalls(facts)] == ["clip-norm-too-large"]
    assert "clip-norm-too-large" not in [f.code for f in find_pitfalls(facts, diagnostics=False)]
    assert "clip-norm-too-large" in codes(facts)  # the run's own terminal shows them all


def test_no_norm_statistics_means_no_clip_finding(clean):
    assert codes(dataclasses.replace(clean, grad_norms=None)) == []


def test_gradient_norm_statistics_are_the_sample_quantiles():
    stats = GradNormStats.from_norms(np.arange(1.0, 11.0), 5.0)
    assert (stats.count, stats.median, stats.maximum, stats.mean) == (10, 5.5, 10.0, 5.5)
    assert stats.fraction_clipped == 0.5 and stats.p10 == pytest.approx(1.9)
    with pytest.raises(ValueError, match="no gradient norms"):
        GradNormStats.from_norms([], 1.0)


# -- tuning ---------------------------------------------------------------------------------------


def test_private_tuning_without_ledger_events_is_an_error(clean):
    finding = only(
        dataclasses.replace(clean, tuning=TuningFacts("private", 7)), "tuning-not-accounted"
    )
    assert finding.severity is Severity.ERROR and "7 tuning trial(s)" in finding.evidence


def test_accounted_or_public_tuning_passes(clean, tuned_ledger_facts):
    accounted = dataclasses.replace(
        clean, tuning=TuningFacts("private", 7), accounting=tuned_ledger_facts
    )
    assert "tuning-not-accounted" not in codes(accounted)
    assert "tuning-not-accounted" not in codes(
        dataclasses.replace(clean, tuning=TuningFacts("public", 50))
    )


def test_a_tuning_choice_at_its_grid_edge_is_a_warning_in_the_final_report(clean):
    edge = "the tuning chose clip norm C = 0.1, the smallest value of its grid (0.1, 1)."
    tuned = dataclasses.replace(clean, tuning=TuningFacts("public", 5, grid_edges=(edge,)))
    finding = only(tuned, "tuning-grid-edge")
    assert finding.severity is Severity.WARNING and edge in finding.evidence
    assert "tuning-grid-edge" not in codes(
        dataclasses.replace(clean, tuning=TuningFacts("public", 5))
    )
    assert RunFacts.from_dict(tuned.to_dict()).tuning.grid_edges == (edge,)


# -- registry -------------------------------------------------------------------------------------


def test_every_detector_is_registered_and_names_are_unique():
    assert set(DETECTORS) >= {
        "batch-coupled-layer",
        "sampling-not-poisson",
        "delta-too-large",
        "preprocessing-fitted-on-private-data",
        "sequence-loss-not-normalised",
        "frozen-parameters",
        "unnoised-parameters",
        "sparse-gradients",
        "clip-norm-mismatch",
        "tuning-not-accounted",
        "user-level-claim",
    }
    with pytest.raises(ValueError, match="already registered"):
        detector("delta-too-large")(lambda facts: ())


def test_findings_come_errors_first_and_serialise(clean, monkeypatch):
    info = Finding("zz-info", Severity.INFO, "t", "e", "f", "§1")
    monkeypatch.setitem(DETECTORS, "test-info", lambda facts: [info])
    facts = with_privacy(clean, sampler="shuffle", delta=0.5)
    found = find_pitfalls(facts)
    assert [f.severity for f in found] == sorted((f.severity for f in found), key=lambda s: s.rank)
    assert found[-1] == info and found[0].severity is Severity.ERROR
    assert info.to_dict() == {
        "code": "zz-info",
        "severity": "info",
        "title": "t",
        "evidence": "e",
        "fix": "f",
        "guide_section": "§1",
    }
