"""The report, history.json and the plots say what a PyTorch user needs, once and honestly."""

from __future__ import annotations

import io
import itertools
import json
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from rich.console import Console
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.plan.accounting import GaussianEvent, PoissonSampledEvent
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.report import provenance
from dpfy.report.facts import ResultFacts, RunFacts, TuningFacts, collect_facts
from dpfy.report.history import (
    HISTORY_FORMAT,
    NOT_PRIVATE_TAG,
    history_document,
    read_history,
    write_history,
)
from dpfy.report.plots import epsilon_curve, epsilon_figure
from dpfy.report.render import build_report, render_run, write_report
from dpfy.report.training_plot import BASELINE_LABEL, training_figure
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.step_record import StepRecord

N, B, STEPS, SIGMA = 200, 20, 6, 1.2


class _Record:  # the shape of a dataset's preprocessing record
    steps = ("pixel / 16 (fixed constant)",)
    fitted_on_private_data = False
    declared_public = False


def _run(sampler: str = "poisson") -> dpfy.PrivateTraining:
    """A few DP-SGD steps of a tiny classifier on random data."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=generator)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shuffle sampler warns
        run = dpfy.make_private(
            model, optimizer, data, batch_size=B, steps=STEPS, noise_multiplier=SIGMA,
            delta=1e-4, max_grad_norm=1.0, sampler=sampler, seed=0,
        )  # fmt: skip
        for xb, yb in rest_of_run(run.loader):
            run.optimizer.zero_grad()
            nn.functional.cross_entropy(run.model(xb), yb).backward()
            run.optimizer.step()
    return run


def _facts(run: dpfy.PrivateTraining, **declared) -> RunFacts:
    return collect_facts(
        run, dataset_name="random", model_name="linear", preprocessing=_Record(), **declared
    )


@pytest.fixture(scope="module")
def poisson_run() -> dpfy.PrivateTraining:
    return _run("poisson")


# -- the report -----------------------------------------------------------------------------------


def test_a_preprocessing_step_is_stated_on_one_line_without_repeating_itself(poisson_run):
    md = build_report(_facts(poisson_run)).to_markdown()
    lines = [line for line in md.splitlines() if "Preprocessing" in line]
    assert lines == ["- Preprocessing (fixed): pixel / 16 (fixed constant)"]


def test_equal_poisson_and_proven_epsilon_are_stated_in_one_line(poisson_run):
    card = build_report(_facts(poisson_run))
    eps = card.to_json()["epsilon"]
    assert eps["under_poisson_assumption"] == pytest.approx(eps["proven_total"], rel=1e-12)
    lines = [line for line in card.to_markdown().splitlines() if "Poisson-sampling" in line]
    assert len(lines) == 1 and "also the ε proven for the sampling actually used" in lines[0]
    assert "- ε proven for the sampling actually used" not in card.to_markdown()


def test_shuffled_batches_keep_the_assumed_and_the_unknown_proven_epsilon_apart():
    md = build_report(_facts(_run("shuffle"))).to_markdown()
    assert "- ε under the Poisson-sampling assumption: " in md
    assert "- ε proven for the sampling actually used: not known" in md
    assert "which is also" not in md


def test_the_guard_note_says_tuning_trials_ran_before_the_final_training(poisson_run):
    run = _run("poisson")
    run.ledger.target_epsilon = 1.01 * run.ledger.epsilon()
    run.ledger.record_event(
        PoissonSampledEvent(B / N, GaussianEvent(SIGMA)), label="tuning", count=30
    )
    md = build_report(_facts(run, tuning=TuningFacts("private", 3))).to_markdown()
    (line,) = [x for x in md.splitlines() if x.startswith("- target ε (budget guard)")]
    assert "tuning trials ran before this training run" in line
    (tuning,) = [x for x in md.splitlines() if x.startswith("- tuning: ε_tuning")]
    assert "the tuning trials ran before this training run" in tuning
    assert "after training (e.g. the tuning" not in md


def test_software_names_the_dpfy_commit_and_a_rerender_keeps_it(poisson_run, tmp_path):
    facts = _facts(poisson_run)
    commit = facts.software["dpfy commit"]
    assert commit == provenance.source_commit()
    if shutil.which("git") and commit != provenance.NOT_A_CHECKOUT:
        assert re.fullmatch(r"[0-9a-f]{40}( \(with uncommitted changes to the package source\))?",
                            commit)  # fmt: skip
    write_report(facts, tmp_path, plots=False)
    assert f"- dpfy commit {commit}" in render_run(tmp_path)
    assert json.loads(render_run(tmp_path, "json"))["software"]["dpfy commit"] == commit


def test_source_outside_a_git_checkout_is_said_so_without_failing(tmp_path, monkeypatch):
    assert provenance.source_commit(tmp_path) == provenance.NOT_A_CHECKOUT
    assert provenance.source_commit(tmp_path / "missing") == provenance.NOT_A_CHECKOUT
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert provenance.source_commit() == provenance.NOT_A_CHECKOUT


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_is_flagged_dirty_and_an_untracked_package_is_no_checkout(tmp_path):
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True)
        return done.stdout.strip()

    git("init", "-q")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("x = 1\n")
    assert provenance.source_commit(package) == provenance.NOT_A_CHECKOUT  # not tracked yet
    git("add", "pkg/__init__.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    assert provenance.source_commit(package) == head
    (package / "__init__.py").write_text("x = 2\n")
    assert provenance.source_commit(package) == (
        f"{head} (with uncommitted changes to the package source)"
    )


# -- history.json ---------------------------------------------------------------------------------

ROWS = [
    {"step": s, "epoch": s / 10, "loss": 2 / s, "train_accuracy": 0.5, "test_accuracy": 0.6,
     "epsilon": s / 20}
    for s in range(1, 6)
]  # fmt: skip


def test_history_marks_train_metrics_not_private_and_test_metrics_released(tmp_path):
    doc = history_document([*ROWS, {"step": 6, "val_loss": 0.1}])
    assert doc["format"] == HISTORY_FORMAT
    assert doc["not_private"]["fields"] == ["loss", "train_accuracy", "val_loss"]  # unknown: not
    assert "NOT covered by the DP guarantee" in doc["not_private"]["why"]
    assert doc["released"]["fields"] == ["step", "epoch", "test_accuracy", "epsilon"]
    write_history(tmp_path / "history.json", ROWS)
    assert read_history(tmp_path / "history.json") == ROWS
    (tmp_path / "old.json").write_text(json.dumps(ROWS))  # the bare list older runs wrote
    assert read_history(tmp_path / "old.json") == ROWS
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a dpfy history"):
        read_history(tmp_path / "bad.json")


@pytest.fixture
def drawn(monkeypatch) -> dict:
    """The keyword arguments each of the run directory's training plots was drawn with."""
    from dpfy.report import training_plot

    seen: dict = {}
    real = training_plot.plot_training_curves

    def spy(history, path, **kwargs):
        seen[Path(path).name] = kwargs
        return real(history, path, **kwargs)

    monkeypatch.setattr(training_plot, "plot_training_curves", spy)
    return seen


def test_dpfy_train_writes_a_labelled_history_and_draws_the_baseline(tmp_path, drawn):
    from dpfy.jobs.config import TrainConfig
    from dpfy.jobs.train import run_training

    config = TrainConfig(epochs=1, baseline=True, out=tmp_path / "run", seed=0)
    result = run_training(config, Console(file=io.StringIO()))
    doc = json.loads((tmp_path / "run" / "history.json").read_text())
    assert doc["not_private"]["fields"] == ["loss", "train_accuracy"]
    assert doc["rows"] == result.history
    # the baseline is drawn on the diagnostics plot, never on the one beside the card
    assert drawn["diagnostics.png"]["baseline_accuracy"] == result.baseline_accuracy is not None
    assert drawn["training.png"] == {"private_curves": False}


def test_write_report_draws_the_facts_baseline_on_the_diagnostics_plot(
    poisson_run, tmp_path, drawn
):
    facts = _facts(poisson_run, results=ResultFacts(accuracy=0.8, baseline_accuracy=0.9))
    written = write_report(facts, tmp_path, history=ROWS)
    assert written["training_plot"].read_bytes()[:4] == b"\x89PNG"
    assert written["diagnostics_plot"].read_bytes()[:4] == b"\x89PNG"
    assert drawn == {
        "training.png": {"private_curves": False},
        "diagnostics.png": {"baseline_accuracy": 0.9},
    }


# -- the plots ------------------------------------------------------------------------------------


def _overlaps(figure) -> list[str]:
    """Every pair of texts that overlap, and every text or legend box that covers a curve."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = [t for t in _drawn_texts(figure) if t.get_visible() and t.get_text().strip()]
    boxes = [(t.get_text(), t.get_window_extent(renderer).padded(-1)) for t in texts]
    legends = [*figure.legends, *(a.get_legend() for a in figure.axes if a.get_legend())]
    boxes += [("legend", legend.get_window_extent(renderer)) for legend in legends]
    found = [
        f"{a!r} overlaps {b!r}"
        for i, (a, box) in enumerate(boxes)
        for b, other in boxes[i + 1 :]
        if box.overlaps(other) and not ("legend" in (a, b) and _inside(box, other))
    ]
    for axes in figure.axes:
        for line in axes.get_lines():
            points = _dense(line.get_transform().transform(line.get_xydata()))
            points = points[_within(axes.bbox, points)]  # what is drawn
            found += [f"{name!r} covers a curve" for name, box in boxes
                      if _within(box, points).any()]  # fmt: skip
    return found


def _drawn_texts(figure) -> list[Text]:
    """Every text artist, with tick labels only for ticks inside the view (the ones drawn)."""
    ticks, shown = set(), []
    for axis in figure.findobj(Axis):
        low, high = sorted(axis.get_view_interval())
        for tick in axis.get_major_ticks() + axis.get_minor_ticks():
            labels = (tick.label1, tick.label2)
            ticks.update(map(id, labels))
            if low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                shown += labels
    return [t for t in figure.findobj(Text) if id(t) not in ticks] + shown


def _within(box, points: np.ndarray) -> np.ndarray:
    """Which display points lie inside ``box``."""
    x, y = points[:, 0], points[:, 1]
    return (box.x0 <= x) & (x <= box.x1) & (box.y0 <= y) & (y <= box.y1)


def _inside(a, b) -> bool:
    """A legend's own entries sit inside its frame."""
    return all(b.contains(x, y) for x, y in a.corners()) or all(
        a.contains(x, y) for x, y in b.corners()
    )


def _dense(points: np.ndarray, per_segment: int = 40) -> np.ndarray:
    """Points along a polyline (display coordinates), so a text crossing a segment is caught."""
    if len(points) < 2:
        return points
    t = np.linspace(0, 1, per_segment)[:, None]
    pieces = [a + t * (b - a) for a, b in itertools.pairwise(points)]
    return np.concatenate(pieces)


def _ledger(steps: int, sigma: float, *, tuning: bool = False) -> PrivacyLedger:
    book = PrivacyLedger(1e-5)
    record = SamplingRecord(SamplingKind.POISSON, 0.02, 5000)
    for _ in range(steps):
        book.record(StepRecord(record, sigma))
    if tuning:
        book.record_event(PoissonSampledEvent(0.02, GaussianEvent(sigma)), label="tuning", count=50)
    return book


@pytest.mark.parametrize(("steps", "sigma", "tuning"), [(23, 1.07, False), (400, 0.8, True),
                                                         (5, 3.0, False)])  # fmt: skip
def test_epsilon_plot_labels_never_overlap_each_other_or_the_curves(steps, sigma, tuning):
    curve = epsilon_curve(_ledger(steps, sigma, tuning=tuning))
    figure = epsilon_figure(curve)
    assert _overlaps(figure) == []
    labels = figure.legends[0].get_texts()
    assert [t.get_text() for t in labels][:2] == [
        f"PLD accountant: ε = {curve.pld[-1]:.3g} after {steps} steps",
        f"RDP accountant: ε = {curve.rdp[-1]:.3g} after {steps} steps",
    ]


def test_training_plot_labels_private_data_curves_and_draws_the_baseline():
    figure, curves = training_figure(ROWS, baseline_accuracy=0.93)
    assert curves.labels["loss"] == f"train loss ({NOT_PRIVATE_TAG})"
    assert curves.labels["train_accuracy"] == f"train accuracy ({NOT_PRIVATE_TAG})"
    assert curves.labels["test_accuracy"] == "test accuracy"
    accuracy_axes = figure.axes[1]
    baseline = [line for line in accuracy_axes.get_lines() if BASELINE_LABEL in line.get_label()]
    assert len(baseline) == 1 and list(baseline[0].get_ydata()) == [0.93, 0.93]
    assert (
        NOT_PRIVATE_TAG in figure.get_suptitle() and "NOT FOR PUBLICATION" in figure.get_suptitle()
    )
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert set(curves.labels.values()) | {"ε spent"} == set(legend)
    assert _overlaps(figure) == []


def test_the_published_training_plot_draws_only_released_curves():
    figure, curves = training_figure(ROWS, private_curves=False)
    assert set(curves.labels) == {"test_accuracy"} and curves.labels["test_accuracy"] == (
        "test accuracy"
    )
    assert NOT_PRIVATE_TAG not in figure.get_suptitle()
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert set(legend) == {"test accuracy", "ε spent"}
    assert _overlaps(figure) == []
    with pytest.raises(ValueError, match="never on the published plot"):
        training_figure(ROWS, baseline_accuracy=0.9, private_curves=False)


def test_training_plot_without_a_baseline_or_private_curves_has_neither_label():
    figure, curves = training_figure([{"step": 1, "test_accuracy": 0.5, "epsilon": 0.1}])
    assert curves.baseline_accuracy is None
    assert not any(BASELINE_LABEL in line.get_label() for line in figure.axes[1].get_lines())
    assert NOT_PRIVATE_TAG not in figure.get_suptitle()
    with pytest.raises(ValueError, match="baseline_accuracy"):
        training_figure(ROWS, baseline_accuracy=93.0)
