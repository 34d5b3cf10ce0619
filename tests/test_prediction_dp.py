"""Prediction-level DP: the served ensemble, its aggregators and its query ledger (issue 20)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import optimize, stats
from torch import nn
from torch.utils.data import TensorDataset

from dpfy.access import ConfidentGNMax, GNMax, PrivateEnsemble, QueryBudgetExhausted, QueryLedger
from dpfy.access.prediction_aggregator import UNANSWERED
from dpfy.access.prediction_partition import assign_partitions, partition_indices
from dpfy.train.models import build_model
from dpfy.train.noise.source import TorchNoise

dpa = pytest.importorskip("dp_accounting")
from dp_accounting import pld as dpa_pld  # noqa: E402
from dp_accounting import rdp as dpa_rdp  # noqa: E402

DELTA = 1e-5


def blobs(n: int = 240, seed: int = 0) -> TensorDataset:
    """Three well-separated Gaussian blobs in 4 dimensions: teachers agree, answers are cheap."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    centres = torch.eye(3, 4) * 4.0
    features = centres[labels] + torch.randn(n, 4, generator=generator)
    return TensorDataset(features, labels)


def fit(aggregator, epsilon: float = 2.0, teachers: int = 8, **options) -> PrivateEnsemble:
    """A small seeded ensemble of linear teachers on the blobs."""
    return PrivateEnsemble.fit(
        blobs(),
        lambda: nn.Linear(4, 3),
        teachers=teachers,
        aggregator=aggregator,
        epsilon=epsilon,
        delta=DELTA,
        num_classes=3,
        epochs=5,
        seed=0,
        **options,
    )


# -- the budget ---------------------------------------------------------------------------------


def test_answers_stop_at_the_budget_and_a_refused_query_changes_and_releases_nothing():
    ensemble = fit(GNMax(8.0))
    capacity = ensemble.ledger.capacity()
    assert 2 < capacity < 200
    queries = blobs(capacity + 1, seed=1).tensors[0]
    for row in queries[:capacity]:
        ensemble.answer(row[None])
    assert ensemble.ledger.asked == ensemble.ledger.answered == capacity
    assert ensemble.epsilon() <= 2.0 < ensemble.epsilon(capacity + 1)
    before = (ensemble.ledger.state_dict(), ensemble.noise.generator.get_state())
    with pytest.raises(QueryBudgetExhausted) as refused:
        ensemble.answer(queries[capacity:])
    message = str(refused.value)
    assert "ε=2" in message and f"{capacity} queries have been accounted" in message
    assert ensemble.ledger.state_dict() == before[0]
    assert torch.equal(ensemble.noise.generator.get_state(), before[1])  # no noise drawn


def test_a_batch_that_does_not_fit_is_refused_whole_and_a_smaller_one_still_answers():
    ensemble = fit(GNMax(8.0))
    capacity = ensemble.ledger.capacity()
    queries = blobs(capacity + 1, seed=1).tensors[0]
    with pytest.raises(QueryBudgetExhausted, match=f"{capacity} more fit"):
        ensemble.answer(queries)
    assert ensemble.ledger.asked == 0
    assert len(ensemble.answer(queries[:capacity])) == capacity
    assert ensemble.ledger.remaining() == 0


def test_confident_gnmax_charges_every_query_answered_or_not():
    ensemble = fit(ConfidentGNMax(threshold=1e6, threshold_noise=20.0, noise_multiplier=30.0))
    labels = ensemble.answer(blobs(6, seed=2).tensors[0])
    assert (labels == UNANSWERED).all()
    assert ensemble.ledger.asked == 6 and ensemble.ledger.answered == 0
    assert ensemble.epsilon() > 0


# -- ε of k answers, independently --------------------------------------------------------------


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε(δ) of a Gaussian mechanism of sensitivity/std μ (Balle & Wang 2018, Thm 8)."""

    def excess(epsilon: float) -> float:
        tail = stats.norm.cdf(-epsilon / mu + mu / 2)
        return tail - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2) - delta

    return optimize.brentq(excess, 0.0, 500.0, xtol=1e-12)


@pytest.mark.parametrize(("sigma", "k"), [(4.0, 1), (10.0, 30), (40.0, 500), (100.0, 5000)])
def test_epsilon_of_k_gnmax_answers_matches_dp_accounting_and_the_exact_gaussian(sigma, k):
    # dp_accounting's GaussianDpEvent(m) is std m per unit sensitivity; GNMax's sensitivity is √2.
    event = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma / math.sqrt(2)), k)
    theirs_pld = dpa_pld.PLDAccountant(value_discretization_interval=1e-4).compose(event)
    theirs_rdp = dpa_rdp.RdpAccountant().compose(event)
    exact = analytic_gaussian_epsilon(math.sqrt(2 * k) / sigma, DELTA)
    pld = QueryLedger(100.0, DELTA, GNMax(sigma), accountant="pld").epsilon(k)
    rdp = QueryLedger(100.0, DELTA, GNMax(sigma), accountant="rdp").epsilon(k)
    assert pld == pytest.approx(theirs_pld.get_epsilon(DELTA), rel=2e-3)
    assert pld >= exact * (1 - 1e-9) and pld == pytest.approx(exact, rel=5e-3)
    assert rdp == pytest.approx(theirs_rdp.get_epsilon(DELTA), rel=1e-2)
    assert rdp >= exact


def test_epsilon_of_k_confident_queries_matches_dp_accounting():
    sigma1, sigma2, k = 30.0, 20.0, 200
    per_query = dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(sigma1), dpa.GaussianDpEvent(sigma2 / math.sqrt(2))]
    )
    theirs = dpa_pld.PLDAccountant(value_discretization_interval=1e-4)
    theirs.compose(dpa.SelfComposedDpEvent(per_query, k))
    mu = math.sqrt(k * (1 / sigma1**2 + 2 / sigma2**2))  # Gaussians compose to one Gaussian
    ledger = QueryLedger(100.0, DELTA, ConfidentGNMax(100.0, sigma1, sigma2))
    assert ledger.epsilon(k) == pytest.approx(theirs.get_epsilon(DELTA), rel=2e-3)
    assert ledger.epsilon(k) == pytest.approx(analytic_gaussian_epsilon(mu, DELTA), rel=5e-3)


def test_replace_one_doubles_the_sensitivity_of_each_answer():
    sigma, k = 20.0, 50
    ledger = QueryLedger(100.0, DELTA, GNMax(sigma), relation="replace-one")
    exact = analytic_gaussian_epsilon(2 * math.sqrt(2 * k) / sigma, DELTA)
    assert ledger.epsilon(k) == pytest.approx(exact, rel=5e-3)


# -- the noise ----------------------------------------------------------------------------------


class Recording(TorchNoise):
    """A seeded source that keeps every draw, to measure the noise the aggregator added."""

    def __init__(self) -> None:
        super().__init__(seed=3)
        self.draws: list[tuple[float, torch.Tensor]] = []

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        draw = super().normal(like, std)
        self.draws.append((std, draw.clone()))
        return draw


def within_chi_square(values: torch.Tensor, sigma: float) -> bool:
    """Whether the sample variance of zero-mean noise is consistent with σ² (two-sided 1e-4)."""
    n = values.numel()
    statistic = float((values.double() ** 2).sum()) / sigma**2
    return stats.chi2.ppf(1e-4, n) < statistic < stats.chi2.ppf(1 - 1e-4, n)


def test_gnmax_noise_has_std_sigma_and_flips_labels_at_the_gaussian_rate():
    sigma, margin, n = 6.0, 5.0, 20_000
    histogram = torch.zeros(n, 4, dtype=torch.float64)
    histogram[:, 0], histogram[:, 1] = 10.0 + margin, 10.0
    noise = Recording()
    labels = GNMax(sigma).aggregate(histogram, noise)
    ((std, draw),) = noise.draws
    assert std == sigma and within_chi_square(draw, sigma)
    assert not within_chi_square(draw, sigma * 1.05)
    first = float((labels == 0).mean(dtype=torch.float64))
    # P(label 0) = P(argmax of four noisy counts is the one ahead by `margin`), by simulation-free
    # integration: ∫ φ(z) Φ((z·σ + margin)/σ) Φ((z·σ + 15)/σ)² dz over the winner's noise z.
    grid = np.linspace(-8, 8, 4001)
    density = stats.norm.pdf(grid) * stats.norm.cdf(grid + margin / sigma)
    density *= stats.norm.cdf(grid + 15.0 / sigma) ** 2
    expected = float(np.trapezoid(density, grid))
    assert first == pytest.approx(expected, abs=4 * math.sqrt(expected * (1 - expected) / n))


def test_confident_gnmax_check_has_std_sigma1_and_answers_with_sigma2():
    histogram = torch.zeros(20_000, 3, dtype=torch.float64)
    histogram[:, 0] = 50.0
    noise = Recording()
    labels = ConfidentGNMax(threshold=50.0, threshold_noise=4.0, noise_multiplier=9.0).aggregate(
        histogram, noise
    )
    (std1, check), (std2, answer) = noise.draws
    assert (std1, std2) == (4.0, 9.0)
    assert within_chi_square(check, 4.0) and within_chi_square(answer, 9.0)
    answered = float((labels != UNANSWERED).mean(dtype=torch.float64))
    assert answered == pytest.approx(0.5, abs=0.015)  # the top count sits on the threshold


# -- partitions ---------------------------------------------------------------------------------


def test_partitions_are_disjoint_cover_every_record_and_are_fixed_per_record():
    data = blobs(300)
    features, labels = data.tensors
    assignment = assign_partitions(features, labels, 7, seed=0)
    parts = partition_indices(assignment, 7)
    assert sorted(np.concatenate(parts).tolist()) == list(range(300))
    assert all(len(p) > 0 for p in parts)
    keep = torch.arange(300) != 17  # remove one record
    removed = assign_partitions(features[keep], labels[keep], 7, seed=0)
    assert np.array_equal(removed, assignment[keep.numpy()])
    order = torch.randperm(300, generator=torch.Generator().manual_seed(1))  # reorder them
    assert np.array_equal(
        assign_partitions(features[order], labels[order], 7, 0), assignment[order]
    )
    extra = torch.cat([features, torch.randn(1, 4)]), torch.cat([labels, torch.tensor([2])])
    assert np.array_equal(assign_partitions(*extra, 7, seed=0)[:300], assignment)  # add one
    assert not np.array_equal(assign_partitions(features, labels, 7, seed=1), assignment)


# -- saved state --------------------------------------------------------------------------------


def test_ledger_state_round_trips_with_its_ensemble(tmp_path):
    ensemble = fit(GNMax(8.0))
    ensemble.answer(blobs(3, seed=4).tensors[0])
    path = ensemble.save(tmp_path / "ensemble.pt")
    loaded = PrivateEnsemble.load(path, lambda: nn.Linear(4, 3), seed=5)
    assert loaded.ledger.state_dict() == ensemble.ledger.state_dict()
    assert loaded.epsilon() == ensemble.epsilon()
    loaded.answer(blobs(2, seed=6).tensors[0])
    assert loaded.ledger.asked == 5
    state = ensemble.ledger.state_dict()
    assert QueryLedger.from_state_dict(state, ensemble.fingerprint()).asked == 3


def test_a_tampered_ledger_state_is_refused():
    ensemble = fit(GNMax(8.0))
    ensemble.answer(blobs(3, seed=4).tensors[0])
    state = ensemble.ledger.state_dict()
    for field, value in (("asked", 0), ("epsilon", 50.0), ("aggregator", GNMax(80.0).spec())):
        with pytest.raises(ValueError, match="does not match its digest"):
            QueryLedger.from_state_dict({**state, field: value}, ensemble.fingerprint())
    with pytest.raises(ValueError, match="another ensemble"):
        QueryLedger.from_state_dict(state, fit(GNMax(8.0), teachers=9).fingerprint())


def test_a_saved_ensemble_whose_teachers_changed_is_refused(tmp_path):
    ensemble = fit(GNMax(8.0))
    path = ensemble.save(tmp_path / "ensemble.pt")
    state = torch.load(path, weights_only=True)
    state["teachers"][0]["bias"] += 1.0
    torch.save(state, path)
    with pytest.raises(ValueError, match="another ensemble"):
        PrivateEnsemble.load(path, lambda: nn.Linear(4, 3))


# -- the job ------------------------------------------------------------------------------------


def test_the_prediction_job_answers_the_test_split_until_the_budget_and_reports_it(tmp_path):
    from dpfy.jobs.access import access_job
    from dpfy.jobs.config import TrainConfig

    config = TrainConfig(
        dataset="digits", epochs=2, target_epsilon=4.0, seed=0, out=tmp_path / "run",
        access="prediction",
    )  # fmt: skip
    result = access_job("prediction")(config)
    run = result.run_dir
    report = (run / "report.md").read_text(encoding="utf-8")
    assert "only the served answers are protected" in report and "never released" in report
    assert "the dataset size N alone, which is treated as public" in report
    assert "Refused: query budget exhausted" in report
    document = json.loads((run / "report.json").read_text(encoding="utf-8"))
    answered = document["queries_answered"]
    assert 0 < answered == document["capacity"] < document["queries_offered"] == 360
    assert len(json.loads((run / "answers.json").read_text(encoding="utf-8"))["labels"]) == answered
    assert result.epsilon <= 4.0 and result.steps == answered
    config_file = json.loads((run / "config.json").read_text(encoding="utf-8"))
    model = lambda: build_model(config_file["model"], (1, 8, 8), 10)  # noqa: E731
    served = PrivateEnsemble.load(run / "ensemble.pt", model)
    assert served.ledger.state_dict() == json.loads((run / "ledger.json").read_text("utf-8"))
    with pytest.raises(QueryBudgetExhausted):
        served.answer(torch.zeros(1, 1, 8, 8))


def test_fit_refuses_labels_outside_the_declared_classes_naming_the_fix():
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\).*num_classes"):
        PrivateEnsemble.fit(
            blobs(), lambda: nn.Linear(4, 3), teachers=4, aggregator=GNMax(2.0), epsilon=1.0,
            delta=DELTA, num_classes=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="TensorDataset"):
        PrivateEnsemble.fit(
            [(torch.zeros(4), 0)], lambda: nn.Linear(4, 3), teachers=4, aggregator=GNMax(2.0),
            epsilon=1.0, delta=DELTA, num_classes=3,
        )  # fmt: skip


def test_teachers_wider_than_the_declared_classes_are_refused_before_any_query_is_charged():
    # a vote outside [0, num_classes) would depend on the private teachers: whether a request
    # errors or is answered must not, so the width is checked once, on the architecture alone
    wide = [nn.Linear(4, 3) for _ in range(4)]
    with torch.no_grad():
        for teacher in wide:
            teacher.bias.copy_(torch.tensor([0.0, 0.0, 5.0]))  # class 2 wins on every query
    from dpfy.access.prediction import _fingerprint

    binding = _fingerprint(wide, GNMax(2.0), 2, 0)
    ledger = QueryLedger(2.0, DELTA, GNMax(2.0), binding=binding)
    with pytest.raises(ValueError, match=r"3 classes.*num_classes=2"):
        PrivateEnsemble(wide, GNMax(2.0), ledger, num_classes=2, input_shape=(4,),
                        partition_seed=0)  # fmt: skip
    assert ledger.asked == 0


def test_removing_one_record_changes_one_teachers_weights_and_no_other():
    # the sensitivity argument end to end: partitions, seeds and training of every other
    # teacher must not depend on the removed record
    data = blobs()
    keep = torch.arange(len(data)) != 17
    smaller = TensorDataset(data.tensors[0][keep], data.tensors[1][keep])
    ensembles = [
        PrivateEnsemble.fit(d, lambda: nn.Linear(4, 3), teachers=8, aggregator=GNMax(8.0),
                            epsilon=2.0, delta=DELTA, num_classes=3, epochs=3, seed=0)
        for d in (data, smaller)
    ]  # fmt: skip

    def weights(model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    same = [
        torch.equal(weights(s), weights(t))
        for s, t in zip(ensembles[0].teachers, ensembles[1].teachers, strict=True)
    ]
    assert same.count(False) == 1
