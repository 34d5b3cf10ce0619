"""The card meant for publication holds only released or public facts (design rule 19).

``report.md`` and ``report.json`` are what a user publishes; un-noised statistics of the private
data (per-example gradient norms, a non-private baseline, checks that read them) go to
``diagnostics.md`` / ``diagnostics.json``, whose first line says not to publish them. ``dpfy
tune`` trains no model on the private data outside the ε total it prints.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import dpfy
from dpfy.cli.app import app
from dpfy.data.loader import rest_of_run
from dpfy.report.facts import GradNormStats, ResultFacts, RunFacts, collect_facts, record_clip_norms
from dpfy.report.render import render_run, write_report

N, B, STEPS, C = 64, 32, 8, 0.02
BASELINE = 0.9173  # a figure no other part of the card prints
OUTLIER = 1000.0  # the scale of the one record whose gradient is huge
ROWS = [
    {"step": s, "epoch": s * B / N, "loss": 0.7 / s, "train_accuracy": 0.6, "test_accuracy": 0.55,
     "epsilon": 0.1 * s}
    for s in range(1, STEPS + 1)
]  # fmt: skip


def _outlier_run() -> tuple[dpfy.PrivateTraining, np.ndarray]:
    """A few DP-SGD steps of logistic regression on data with one huge-gradient record."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=generator)
    y = (x[:, 0] > 0).long()
    x[0] *= OUTLIER  # one record whose per-example gradient dwarfs the others
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = dpfy.make_private(
            model, optimizer, TensorDataset(x, y), batch_size=B, steps=STEPS,
            noise_multiplier=1.0, delta=1e-3, max_grad_norm=C, seed=0,
        )  # fmt: skip
        with record_clip_norms(run) as log:
            for xb, yb in rest_of_run(run.loader):
                run.optimizer.zero_grad()
                nn.functional.cross_entropy(run.model(xb), yb).backward()
                run.optimizer.step()
    return run, log.norms


@pytest.fixture(scope="module")
def outlier_facts() -> RunFacts:
    run, norms = _outlier_run()
    stats = GradNormStats.from_norms(norms, C)
    assert stats.maximum > 100 * stats.p90  # the outlier was sampled and moved the maximum
    return collect_facts(
        run,
        dataset_name="gaussian-with-outlier",
        model_name="logreg",
        grad_norms=stats,
        results=ResultFacts(accuracy=0.55, baseline_accuracy=BASELINE, evaluated_on="test split"),
    )


@pytest.fixture(scope="module")
def run_dir(outlier_facts: RunFacts, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("run")
    write_report(outlier_facts, target, history=ROWS)
    return target


def _shown(value: float) -> set[str]:
    """The ways a report could print ``value``."""
    return {f"{value:.4g}", f"{value:.6g}", f"{value:g}", repr(value)}


def _leaks(text: str, facts: RunFacts) -> list[str]:
    """Every un-noised statistic of the private data that ``text`` contains."""
    g = facts.grad_norms
    assert g is not None
    found = [f"maximum {s}" for s in _shown(g.maximum) if s in text]
    found += [f"mean {s}" for s in _shown(g.mean) if s in text]
    found += [f"baseline {s}" for s in _shown(BASELINE) if s in text]
    found += [
        word
        for word in ("grad_norms", "fraction_clipped", "baseline_accuracy", "median per-example")
        if word in text
    ]
    return found


def test_the_card_holds_no_gradient_norm_statistic_nor_the_baseline(run_dir, outlier_facts):
    for name in ("report.md", "report.json"):
        text = (run_dir / name).read_text(encoding="utf-8")
        assert _leaks(text, outlier_facts) == [], name
    card = json.loads((run_dir / "report.json").read_text())
    assert "diagnostics" not in card
    assert card["results"]["accuracy"] == 0.55  # held-out test accuracy: customary to publish
    # the card says that a diagnostics file exists, without its values
    assert "diagnostics.md" in (run_dir / "report.md").read_text(encoding="utf-8")


def test_the_diagnostics_file_holds_them_and_says_not_to_publish(run_dir, outlier_facts):
    md = (run_dir / "diagnostics.md").read_text(encoding="utf-8")
    first = md.splitlines()[0]
    assert "NOT FOR PUBLICATION" in first and "DP guarantee" in first
    g = outlier_facts.grad_norms
    assert f"{g.maximum:.4g}" in md and f"{BASELINE:.4g}" in md
    doc = json.loads((run_dir / "diagnostics.json").read_text())
    assert next(iter(doc)) == "not_for_publication"
    assert "NOT FOR PUBLICATION" in doc["not_for_publication"]
    assert doc["grad_norms"]["maximum"] == pytest.approx(g.maximum)
    assert doc["baseline_accuracy"] == BASELINE


def test_a_clip_norm_pitfall_stays_off_the_card_with_its_evidence(run_dir, outlier_facts):
    # C = 0.02 sits far below the median norm: the detector fires, on the private data's norms
    doc = json.loads((run_dir / "diagnostics.json").read_text())
    assert [p["code"] for p in doc["pitfalls"]] == ["clip-norm-too-small"]
    card = json.loads((run_dir / "report.json").read_text())
    assert "clip-norm-too-small" not in [p["code"] for p in card["pitfalls"]]
    md = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "clip-norm-too-small" not in md and "Clip norm far below" not in md
    assert "Clip norm far below" in (run_dir / "diagnostics.md").read_text(encoding="utf-8")


def test_the_published_plots_draw_no_private_curve(run_dir):
    from dpfy.report.training_plot import training_figure

    figure, curves = training_figure(ROWS, private_curves=False)
    assert set(curves.labels) == {"test_accuracy"} and curves.baseline_accuracy is None
    texts = " ".join(t.get_text() for t in figure.findobj(lambda a: hasattr(a, "get_text")))
    assert "train " not in texts and "baseline" not in texts
    assert (run_dir / "training.png").is_file() and (run_dir / "diagnostics.png").is_file()


def test_dpfy_report_rerenders_the_card_and_the_diagnostics_apart(run_dir, outlier_facts):
    assert render_run(run_dir) == (run_dir / "report.md").read_text(encoding="utf-8")
    assert render_run(run_dir, diagnostics=True) == (run_dir / "diagnostics.md").read_text(
        encoding="utf-8"
    )
    card = CliRunner().invoke(app, ["report", str(run_dir)])
    assert card.exit_code == 0 and _leaks(card.stdout, outlier_facts) == []
    diag = CliRunner().invoke(app, ["report", str(run_dir), "--diagnostics", "--format", "json"])
    assert diag.exit_code == 0
    assert json.loads(diag.stdout) == json.loads((run_dir / "diagnostics.json").read_text())


def test_an_interrupted_or_audited_rewrite_keeps_the_split(run_dir, outlier_facts, tmp_path):
    # whatever rewrites the card from the facts (dpfy audit, a re-render) keeps the split
    again = RunFacts.load(run_dir / "facts.json")
    assert again.grad_norms == outlier_facts.grad_norms  # facts.json: the run's own record
    write_report(again, tmp_path, plots=False)
    assert _leaks((tmp_path / "report.md").read_text(encoding="utf-8"), outlier_facts) == []


# -- dpfy train --baseline --------------------------------------------------------------------


def test_dpfy_train_baseline_goes_to_the_terminal_and_diagnostics_not_the_card(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model", "logreg", "--epochs", "0.3", "--baseline", "--out", str(out)]
    summary = CliRunner().invoke(app, args)
    assert summary.exit_code == 0, summary.output
    baseline_line = next(ln for ln in summary.stdout.splitlines() if "non-private" in ln)
    shown = re.search(r"(\d\.\d{4})", baseline_line).group(1)  # the user's own terminal
    assert f"diagnostics (not for publication): {out / 'diagnostics.md'}" in summary.stdout
    facts = RunFacts.load(out / "facts.json")
    baseline = facts.results.baseline_accuracy
    assert baseline is not None and f"{baseline:.4f}" == shown
    for name in ("report.md", "report.json"):
        text = (out / name).read_text(encoding="utf-8")
        assert "baseline_accuracy" not in text and "grad_norms" not in text, name
        assert f"{baseline:.4f}" not in text and f"{baseline:.6g}" not in text, name
        assert facts.grad_norms is not None and f"{facts.grad_norms.maximum:.4g}" not in text
    assert json.loads((out / "diagnostics.json").read_text())["baseline_accuracy"] == baseline


def test_dpfy_train_json_names_the_diagnostics_file(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model", "logreg", "--epochs", "0.3", "--baseline", "--json"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["paths"]["diagnostics.md"] == str(out / "diagnostics.md")
    assert doc["diagnostics"] == str(out / "diagnostics.md")
    assert (
        doc["baseline_accuracy"]
        == json.loads((out / "diagnostics.json").read_text())["baseline_accuracy"]
    )


def test_a_label_dp_baseline_stays_off_its_card(tmp_path):
    out = tmp_path / "label"
    args = ["train", "--access", "label", "--features-public", "--model", "logreg", "--epochs"]
    result = CliRunner().invoke(app, [*args, "1", "--baseline", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    baseline = json.loads(result.stdout)["baseline_accuracy"]  # the user's own terminal
    assert baseline is not None
    for name in ("report.md", "report.json"):
        text = (out / name).read_text(encoding="utf-8")
        assert "baseline_accuracy" not in text and f"{baseline:.4f}" not in text, name
    assert "diagnostics.md" in (out / "report.md").read_text(encoding="utf-8")
    diagnostics = (out / "diagnostics.md").read_text(encoding="utf-8")
    assert diagnostics.startswith("**NOT FOR PUBLICATION") and f"{baseline:.6g}" in diagnostics
    assert json.loads((out / "diagnostics.json").read_text())["baseline_accuracy"] == baseline


# -- dpfy tune --------------------------------------------------------------------------------

FAST = {
    "seed": 0, "limit": 300, "epochs": 1, "trial_epochs": 0.5, "clip_grid": (0.3, 3.0),
    "target_epsilon": 3.0, "accounting": "compose",
}  # fmt: skip


def test_dpfy_tune_trains_no_untuned_run_by_default(tmp_path):
    from dpfy.tune.pipeline import TuneConfig, run_tuning

    assert TuneConfig().compare_default is False
    summary = run_tuning(TuneConfig(out=tmp_path / "tune", **FAST)).summary
    assert summary["untuned_default"] is None
    eps = summary["final"]["epsilon"]
    assert set(eps) == {"training", "tuning", "total"}  # every model trained is in the total
    assert eps["total"] <= 3.0


def test_an_opted_in_untuned_run_is_inside_the_printed_total(tmp_path, capsys):
    from dpfy.tune.command import tune_command

    summary = tune_command(
        dataset="digits", search="clip", trials=5, accounting="compose", public_data=None,
        distribution="poisson", clip_grid="0.3,3", lr_grid="0.01", tolerance=0.02,
        target_epsilon=3.0, epochs=1, trial_epochs=0.5, out=tmp_path / "tune", seed=0,
        compare_default=True, limit=300,
    )  # fmt: skip
    printed = capsys.readouterr().out
    default, final = summary["untuned_default"], summary["final"]
    eps = final["epsilon"]
    own = default["epsilon"]["total"]  # the untuned run alone, at the whole budget
    assert eps["untuned-default"] == pytest.approx(own, rel=1e-9)
    assert eps["total"] > max(own, eps["training"] + 1e-9)  # composed with training and tuning
    report = json.loads(Path(final["report"]).with_suffix(".json").read_text())
    assert report["epsilon"]["total"] == pytest.approx(eps["total"])
    assert report["epsilon"]["other"]["untuned-default"] == pytest.approx(own, rel=1e-9)
    # the untuned accuracy is printed beside the total that includes it
    flat = " ".join(printed.split())
    assert f"{default['test_accuracy']:.4f}" in flat
    assert f"{eps['total']:.3f}" in flat and "untuned default" in flat


def test_dpfy_tune_has_an_opt_in_flag_for_the_untuned_run():
    result = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "200"})
    assert "--compare-default" in result.stdout
