"""Membership inference on a final model: ROC, AUC, TPR at low FPR, scores, plots, ε̂."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from dpfy.audit.membership import (
    LOW_FPRS,
    likelihood_ratio_scores,
    loss_scores,
    membership_inference,
    roc_curve,
)
from dpfy.audit.one_run import score_and_guess
from dpfy.audit.plots import write_audit_plots


def test_auc_equals_the_mann_whitney_statistic():
    rng = np.random.default_rng(0)
    members, others = rng.normal(0.5, 1, 300), rng.normal(0, 1, 400)
    u = stats.mannwhitneyu(members, others).statistic
    assert roc_curve(members, others).auc == pytest.approx(u / (300 * 400))


def test_auc_counts_ties_as_half():
    assert roc_curve(np.array([1.0, 1.0]), np.array([1.0, 1.0])).auc == pytest.approx(0.5)
    assert roc_curve(np.array([2.0, 3.0]), np.array([0.0, 1.0])).auc == pytest.approx(1.0)


def test_tpr_at_fpr_reads_the_best_threshold_within_the_rate():
    members = np.arange(10, 20, dtype=float)  # 10 members above 9 of 10 others but one
    others = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 15], dtype=float)
    curve = roc_curve(members, others)
    assert curve.tpr_at(0.0) == pytest.approx(0.4)  # scores 16–19 flag no other
    assert curve.tpr_at(0.1) == pytest.approx(1.0)


def test_report_states_tpr_at_each_low_fpr_and_the_classical_bound():
    rng = np.random.default_rng(1)
    report = membership_inference(rng.normal(3, 1, 2000), rng.normal(0, 1, 2000), 1e-5)
    assert [f for f, _ in report.tpr_at_fpr] == list(LOW_FPRS)
    assert report.tpr_at_fpr[0][1] < report.tpr_at_fpr[2][1]
    assert report.bound.method == "membership-inference"
    assert report.bound.epsilon_lower_bound > 1.0
    assert report.one_run is None
    assert "independent trial" in report.bound.notes[-1]
    assert report.to_dict()["bound"]["canaries"] == 4000


def test_randomised_members_also_get_the_one_run_bound():
    rng = np.random.default_rng(2)
    report = membership_inference(
        rng.normal(2, 1, 500), rng.normal(0, 1, 500), 1e-5, randomised=True
    )
    assert report.one_run is not None and report.one_run.method == "one-run"
    assert report.one_run.epsilon_lower_bound > 0


def test_tied_scores_reveal_nothing_whatever_order_the_members_come_in():
    # Members first, every score equal: guessing by position would be perfect, by score chance.
    scores, included = np.zeros(400), np.arange(400) < 200
    assert score_and_guess(scores, included, 1e-5, 0.95).epsilon_lower_bound == 0.0


def test_loss_scores_are_per_example_and_leave_the_mode_alone():
    model = torch.nn.Linear(3, 2)
    model.train()
    x, y = torch.randn(7, 3), torch.tensor([0, 1, 0, 1, 0, 1, 0])
    losses = loss_scores(model, x, y, batch_size=3)
    want = torch.nn.functional.cross_entropy(model(x), y, reduction="none").detach().numpy()
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert model.training


def test_loss_scores_refuse_a_reduced_loss():
    with pytest.raises(ValueError, match="one value per example"):
        loss_scores(torch.nn.Linear(3, 2), torch.randn(4, 3), torch.zeros(4, dtype=torch.long),
                    loss=torch.nn.CrossEntropyLoss())  # fmt: skip


def test_likelihood_ratio_flags_an_example_whose_loss_falls_below_its_references():
    rng = np.random.default_rng(3)
    reference = rng.uniform(1.0, 2.0, size=(8, 2))
    reference[:, 1] += 3.0  # example 1 is hard for every model
    target = np.array([1.5, 2.0])  # example 1's loss far below its own references
    scores = likelihood_ratio_scores(target, reference)
    assert scores[1] > 3 and scores[1] > scores[0]


def test_likelihood_ratio_refuses_too_few_references():
    with pytest.raises(ValueError, match="reference models ≥ 2"):
        likelihood_ratio_scores([0.1, 0.2], [[0.1, 0.2]])


def test_audit_plots_are_written_to_the_run_directory(tmp_path):
    rng = np.random.default_rng(4)
    paths = write_audit_plots(rng.normal(1, 1, 100), rng.normal(0, 1, 100), tmp_path, "loss")
    assert sorted(paths) == ["roc", "scores"]
    for path in paths.values():
        assert path.parent == tmp_path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
