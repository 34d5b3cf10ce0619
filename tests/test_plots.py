"""Plots are valid PNGs whose drawn points are exactly what the accountants say."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib import image
from torch import nn

from dpfy.plan.accounting import (
    FixedSizeSampledEvent,
    GaussianEvent,
    PoissonSampledEvent,
    make_accountant,
)
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.report.facts import (
    DatasetFacts,
    RunFacts,
    TrainingFacts,
    accounting_facts,
    model_facts,
)
from dpfy.report.history import NOT_PRIVATE_TAG
from dpfy.report.plots import CURVE_POINTS, epsilon_curve, plot_epsilon_curve
from dpfy.report.training_plot import plot_training_curves, training_figure
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.step_record import StepRecord

N, B, DELTA = 5_000, 50, 1e-5
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def poisson_ledger(steps: int, sigma: float = 1.0, *, delta: float = DELTA) -> PrivacyLedger:
    book = PrivacyLedger(delta)
    record = SamplingRecord(SamplingKind.POISSON, B / N, N)
    for _ in range(steps):
        book.record(StepRecord(record, sigma))
    return book


def pld(q: float, sigma: float, k: int):
    """A PLD accountant holding k Poisson-sampled Gaussian steps."""
    return make_accountant("pld").compose(PoissonSampledEvent(q, GaussianEvent(sigma)), k)


def assert_png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 500
    assert pixels[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    return pixels


def test_epsilon_curve_png_matches_the_accountants(tmp_path):
    book = poisson_ledger(400)  # its speed is a benchmark's business, never a timed assert
    curve = plot_epsilon_curve(book, tmp_path / "epsilon.png")
    assert_png(tmp_path / "epsilon.png")
    assert len(curve.steps) == CURVE_POINTS and curve.steps[0] == 1 and curve.steps[-1] == 400
    assert list(curve.steps) == sorted(set(curve.steps))
    event = PoissonSampledEvent(B / N, GaussianEvent(1.0))
    for i in (0, 11, -1):
        k = curve.steps[i]
        assert curve.pld[i] == pytest.approx(pld(B / N, 1.0, k).epsilon(DELTA), rel=1e-9)
        rdp = make_accountant("rdp").compose(event, k).epsilon(DELTA)
        assert curve.rdp[i] == pytest.approx(rdp, rel=1e-9)
    assert curve.pld[-1] == pytest.approx(book.epsilon(), rel=1e-9)
    assert all(np.diff(curve.pld) > 0) and all(np.diff(curve.rdp) > 0)
    assert all(p < r for p, r in zip(curve.pld, curve.rdp, strict=True))
    assert curve.total_epsilon == pytest.approx(book.epsilon()) and curve.assumptions_met


def test_curve_follows_the_recorded_order_of_heterogeneous_steps():
    book = PrivacyLedger(DELTA)
    record = SamplingRecord(SamplingKind.POISSON, B / N, N)
    for sigma in [1.0] * 50 + [2.0] * 50:
        book.record(StepRecord(record, sigma))
    curve = epsilon_curve(book, points=5)
    assert curve.steps == (1, 26, 50, 75, 100)
    expected = (
        make_accountant("pld")
        .compose(PoissonSampledEvent(B / N, GaussianEvent(1.0)), 50)
        .compose(PoissonSampledEvent(B / N, GaussianEvent(2.0)), 25)
        .epsilon(DELTA)
    )
    assert curve.pld[3] == pytest.approx(expected, rel=1e-9)
    assert curve.pld[-1] == pytest.approx(book.epsilon(), rel=1e-9)


def test_fixed_size_runs_plot_rdp_only():
    book = PrivacyLedger(DELTA, accountant="rdp", relation="replace-one")
    record = SamplingRecord(SamplingKind.FIXED_SIZE, B / N, N, B)
    for _ in range(20):
        book.record(StepRecord(record, 1.0))
    curve = epsilon_curve(book)
    assert curve.pld is None and curve.relation == "replace-one" and len(curve.steps) == 20
    event = FixedSizeSampledEvent(N, B, GaussianEvent(1.0))
    expected = make_accountant("rdp", "replace-one").compose(event, 20).epsilon(DELTA)
    assert curve.rdp[-1] == pytest.approx(expected, rel=1e-9) == book.epsilon()


def test_epsilon_curve_from_saved_facts_marks_unmet_assumption_and_tuning(tmp_path):
    book = PrivacyLedger(DELTA)
    record = SamplingRecord(SamplingKind.SHUFFLE, B / N, N, B)
    with pytest.warns(UserWarning):
        for _ in range(30):
            book.record(StepRecord(record, 1.0))
    book.record_event(PoissonSampledEvent(B / N, GaussianEvent(1.0)), label="tuning", count=100)
    facts = RunFacts(
        dataset=DatasetFacts("d", N),
        model=model_facts(nn.Linear(2, 2), "m"),
        privacy=PrivacyPlan(N, B, B / N, 30, 1.0, 1.0, DELTA, None, "pld", "shuffle", None, "mean"),
        training=TrainingFacts("SGD", 0.1, 30, 0.3),
        accounting=accounting_facts(book),
        software={},
    )
    curve = plot_epsilon_curve(RunFacts.from_dict(facts.to_dict()), tmp_path / "e.png")
    assert_png(tmp_path / "e.png")
    assert not curve.assumptions_met
    assert curve.pld[-1] == pytest.approx(book.epsilon_by_label()["training"], rel=1e-9)
    assert (
        curve.total_epsilon == pytest.approx(book.epsilon()) and curve.total_epsilon > curve.pld[-1]
    )


def test_empty_ledger_has_no_curve(tmp_path):
    with pytest.raises(ValueError, match="no training step"):
        plot_epsilon_curve(PrivacyLedger(DELTA), tmp_path / "e.png")
    with pytest.raises(ValueError, match="expected RunFacts"):
        epsilon_curve(42)


def test_training_curves_plot_every_recorded_series(tmp_path):
    history = [
        {"step": s, "epoch": s / 10, "loss": 2.0 / s, "train_accuracy": 0.5 + s / 100}
        for s in range(1, 21)
    ]
    for row in history[9::10]:
        row["test_accuracy"], row["epsilon"] = 0.6 + row["step"] / 100, row["step"] / 20
    curves = plot_training_curves(history, tmp_path / "training.png")
    assert_png(tmp_path / "training.png")
    assert curves.steps == tuple(range(1, 21))
    assert curves.series["loss"][0] == (1, 2.0) and len(curves.series["loss"]) == 20
    assert curves.series["test_accuracy"] == ((10, 0.7), (20, 0.8))
    assert curves.series["epsilon"] == ((10, 0.5), (20, 1.0))
    assert set(curves.series) == {"loss", "train_accuracy", "test_accuracy", "epsilon"}


def test_training_curves_without_accuracy_or_epsilon_still_draw(tmp_path):
    curves = plot_training_curves([{"step": 1, "loss": 1.0}], tmp_path / "t.png")
    assert curves.series == {"loss": ((1, 1.0),), "epsilon": ()}
    assert_png(tmp_path / "t.png")
    with pytest.raises(ValueError, match="'step'"):
        plot_training_curves([{"loss": 1.0}], tmp_path / "t.png")


def test_every_training_curve_has_its_own_colour_in_the_shared_legend():
    """Train loss and train accuracy share one legend: one colour each, never the same."""
    history = [
        {"step": s, "loss": 1.0 / s, "train_accuracy": s / 10, "test_accuracy": s / 11,
         "test_loss": 2.0 / s, "epsilon": s / 5}
        for s in range(1, 6)
    ]  # fmt: skip
    figure, _ = training_figure(history, baseline_accuracy=0.9)
    drawn = {
        line.get_label(): line.get_color()
        for axes in figure.axes
        for line in axes.get_lines()
        if not line.get_label().startswith("_")
    }
    assert len(drawn) == 6  # loss, test loss, train and test accuracy, ε, the baseline
    assert len(set(drawn.values())) == len(drawn), drawn
    styles = {line.get_label(): line.get_linestyle() for a in figure.axes for line in a.get_lines()}
    private = [label for label in styles if NOT_PRIVATE_TAG in label]
    assert private and all(styles[label] == "--" for label in private)


def test_a_history_without_loss_has_no_empty_panel_and_rounds_are_called_rounds():
    """A federated run records no loss: one accuracy panel (ε on its twin), counted in rounds."""
    from types import SimpleNamespace

    from dpfy.report.render import step_axis

    history = [{"step": r, "epoch": r / 10, "test_accuracy": r / 20, "epsilon": r / 4}
               for r in range(1, 6)]  # fmt: skip
    figure, _ = training_figure(history, step_name="rounds")
    panels = [axes for axes in figure.axes if axes.get_xlabel()]
    assert len(panels) == 1 and panels[0].get_xlabel() == "rounds"
    assert figure.get_suptitle() == "Private training: accuracy against rounds"
    assert not any("no " in text.get_text() for a in figure.axes for text in a.texts)
    federated = SimpleNamespace(privacy=SimpleNamespace(algorithm="dp-fedavg", unit="user"))
    central = SimpleNamespace(privacy=SimpleNamespace(algorithm="dp-sgd", unit="example"))
    assert step_axis(federated) == "rounds"
    assert step_axis(central) is None  # the plots' default axis, "training steps"


def test_audit_plot_titles_carry_the_estimate_and_the_claim_it_tested(tmp_path):
    from dpfy.audit.plots import audit_title, write_audit_plots
    from dpfy.audit.result import AuditResult

    result = AuditResult("classical", 0.8, 0.95, 1e-5, canaries=10, runs=200,
                         claimed_epsilon=1.35, threat_model="white-box")  # fmt: skip
    title = audit_title("1-classical", result)
    assert "ε̂ = 0.8 at 95% confidence" in title
    assert "claimed ε = 1.35 (this audit's run)" in title
    assert audit_title("1-classical") == "1-classical"
    rng = np.random.default_rng(0)
    paths = write_audit_plots(rng.normal(1, 1, 50), rng.normal(0, 1, 50), tmp_path, "1-classical",
                              result=result)  # fmt: skip
    assert_png(paths["roc"])
