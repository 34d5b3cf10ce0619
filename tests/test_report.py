"""The report card states every §5.3.3 item, derived from a real run, and survives a JSON trip."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.plan.accounting import RdpAccountant, dpsgd_event, make_accountant
from dpfy.report import card as card_module
from dpfy.report.diagnostics import diagnostics_document, render_diagnostics
from dpfy.report.facts import (
    FACTS_VERSION,
    PreprocessingStep,
    ResultFacts,
    RunFacts,
    TuningFacts,
    collect_facts,
    preprocessing_steps,
    record_clip_norms,
)
from dpfy.report.render import (
    REPORT_FORMAT,
    SECTIONS,
    build_report,
    render,
    render_run,
    write_report,
)

N, B, STEPS, SIGMA, C, DELTA, LR = 200, 20, 8, 1.3, 0.7, 1e-4, 0.25


def private_run(
    sampler: str = "poisson",
    *,
    microbatch_size: int | None = None,
    freeze: bool = False,
) -> tuple[dpfy.PrivateTraining, np.ndarray]:
    """Logistic regression on random data for a few DP-SGD steps; returns the run and its norms."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, generator=generator)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 2))
    if freeze:
        model[0].requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shuffle sampler warns; the report must say it too
        run = dpfy.make_private(
            model,
            optimizer,
            data,
            batch_size=B,
            steps=STEPS,
            noise_multiplier=SIGMA,
            delta=DELTA,
            max_grad_norm=C,
            sampler=sampler,
            microbatch_size=microbatch_size,
            seed=0,
        )
        with record_clip_norms(run) as log:
            for xb, yb in rest_of_run(run.loader):
                run.optimizer.zero_grad()
                nn.functional.cross_entropy(run.model(xb), yb).backward()
                run.optimizer.step()
    return run, log.norms


def facts_of(run: dpfy.PrivateTraining, norms: np.ndarray | None = None, **declared) -> RunFacts:
    """Collect facts with the trainer's declarations (defaults: a plain example-level run)."""
    grad_norms = None
    if norms is not None and norms.size:
        from dpfy.report.facts import GradNormStats

        grad_norms = GradNormStats.from_norms(norms, C)
    return collect_facts(
        run,
        dataset_name="random-gaussian",
        model_name="two-layer-linear",
        grad_norms=grad_norms,
        results=ResultFacts(accuracy=0.81, baseline_accuracy=0.93, evaluated_on="held-out split"),
        **declared,
    )


@pytest.fixture(scope="module")
def poisson() -> tuple[dpfy.PrivateTraining, RunFacts]:
    run, norms = private_run("poisson")
    return run, facts_of(run, norms)


@pytest.fixture(scope="module")
def shuffled() -> tuple[dpfy.PrivateTraining, RunFacts]:
    run, norms = private_run("shuffle")
    return run, facts_of(run, norms)


# -- every §5.3.3 item, from a known Poisson run ------------------------------------------------


def test_items_1_to_4_setting_release_unit_relation(poisson):
    _, facts = poisson
    card = build_report(facts)
    data, md = card.to_json(), card.to_markdown()
    assert data["dp_setting"]["model"] == "central" and data["dp_setting"]["curator"] == "trusted"
    assert "Central differential privacy with a trusted curator" in md
    assert data["released"]["outputs"] == "final-model" and "Released: only the final model" in md
    assert "post-processing" in md and "§2.2" in md
    assert data["unit_of_privacy"]["unit"] == "example" and "example-level" in md
    assert data["neighbouring_relation"]["relation"] == "add-or-remove"
    assert "Neighbouring relation: add-or-remove" in md
    assert "not comparable" in md


def test_declared_release_and_unit_change_the_report(poisson):
    run, _ = poisson
    facts = facts_of(run, released="every-checkpoint", unit="user")
    card = build_report(facts)
    md = card.to_markdown()
    assert "every checkpoint saved during training" in md and "only the final model" not in md
    unit = card.to_json()["unit_of_privacy"]
    assert unit["unit"] == "user" and "user-level" in unit["statement"]
    assert "Unit of privacy: user-level" in md and "Unit of privacy: example-level" not in md
    assert any(f.code == "user-level-claim" for f in card.findings)
    with pytest.raises(ValueError, match="released must be one of"):
        facts_of(run, released="weights")


def test_item_5_accounting_method_and_parameters(poisson):
    run, facts = poisson
    card = build_report(facts)
    acc = card.to_json()["accounting"]
    assert acc["accountant"] == "pld" and acc["delta"] == DELTA
    assert acc["sampling_rate"] == pytest.approx(B / N) and acc["noise_multiplier"] == SIGMA
    assert acc["max_grad_norm"] == C and acc["steps"] == run.ledger.steps == STEPS
    assert acc["expected_batch_size"] == B and acc["dataset_size"] == N
    assert acc["sampler"] == "poisson" and acc["sensitivity"] == C
    assert acc["noise_std"] == pytest.approx(SIGMA * C)
    md = card.to_markdown()
    for line in ("- σ (noise multiplier): 1.3", "- C (clip norm): 0.7", "- steps accounted: 8"):
        assert line in md
    assert "privacy-loss distribution (PLD)" in md and "Poisson sampling" in md


def test_item_6_poisson_assumption_is_met(poisson):
    _, facts = poisson
    card = build_report(facts)
    assumptions = card.to_json()["assumptions"]
    assert assumptions["all_met"] is True
    assert assumptions["sampling"] == {
        "kind": "poisson",
        "poisson": True,
        "met": True,
        "statement": assumptions["sampling"]["statement"],
    }
    assert assumptions["noise_on_every_trainable_parameter"]["met"] is True
    assert assumptions["noise_on_every_trainable_parameter"]["noised_values"] == 5 * 5 + 5 + 10 + 2
    assert assumptions["frozen_parameters"]["tensors"] == 0
    assert assumptions["clipping"]["sensitivity_in_c"] == 1.0
    md = card.to_markdown()
    assert "Accounting assumptions: **all met**" in md and "- Sampling (poisson): Met" in md
    assert "NOT met" not in md


def test_item_6_shuffled_batches_report_assumption_not_met_and_both_epsilons(shuffled):
    run, facts = shuffled
    card = build_report(facts)
    data, md = card.to_json(), card.to_markdown()
    assert data["assumptions"]["all_met"] is False
    assert data["assumptions"]["sampling"]["met"] is False
    eps = data["epsilon"]
    assert eps["assumptions_met"] is False and eps["proven_total"] is None
    assert eps["under_poisson_assumption"] == pytest.approx(run.ledger.epsilon())
    assert eps["under_poisson_assumption"] == pytest.approx(
        make_accountant("pld").compose(dpsgd_event(B / N, SIGMA, STEPS)).epsilon(DELTA)
    )
    shown = f"{run.ledger.epsilon():.4g}"
    assert f"ε under the Poisson-sampling assumption: {shown}" in md
    assert "ε proven for the sampling actually used: not known" in md
    assert "Accounting assumptions: **NOT all met**" in md and "§4.3" in md
    assert "did NOT meet" in card.headline
    assert any(f.code == "sampling-not-poisson" for f in card.findings)


def test_item_6_frozen_parameters_are_listed_and_trainable_ones_noised():
    run, _ = private_run(freeze=True)
    card = build_report(facts_of(run))
    frozen = card.to_json()["assumptions"]["frozen_parameters"]
    assert frozen["names"] == ["0.weight", "0.bias"] and frozen["values"] == 30
    noise = card.to_json()["assumptions"]["noise_on_every_trainable_parameter"]
    assert noise["met"] is True and noise["noised_values"] == 12
    md = card.to_markdown()
    assert "0.weight, 0.bias" in md and "must come from public data" in md
    assert "(12 trained with DP, 30 frozen)" in md


def test_item_6_microbatching_states_sensitivity_2c():
    run, _ = private_run(microbatch_size=2)
    card = build_report(facts_of(run))
    data = card.to_json()
    assert data["assumptions"]["clipping"]["sensitivity_in_c"] == 2.0
    assert data["accounting"]["sensitivity"] == pytest.approx(2 * C)
    assert data["accounting"]["noise_std"] == pytest.approx(2 * SIGMA * C)
    assert "sensitivity 2C = 1.4, noise std 2σC" in card.to_markdown()


def test_item_7_training_only_when_nothing_was_tuned(poisson):
    run, facts = poisson
    eps = build_report(facts).to_json()["epsilon"]
    by_label = run.ledger.epsilon_by_label()
    assert eps["training"] == by_label["training"] == eps["total"] == eps["proven_total"]
    assert eps["tuning"] is None and eps["tuning_statement"] == "none: no tuning on private data."
    md = build_report(facts).to_markdown()
    assert f"- training: ε = {by_label['training']:.4g} at δ = 0.0001" in md
    public = build_report(facts_of(run, tuning=TuningFacts("public", 20))).to_json()["epsilon"]
    assert public["tuning_statement"].startswith("none on private data: tuning on public data")


def test_target_line_explains_a_total_past_the_guard_from_events_recorded_after_training():
    run, _ = private_run()
    run.ledger.target_epsilon = 1.01 * run.ledger.epsilon()  # the guard that training ran under
    note = "the tuning trials ran before this training run"
    assert note not in build_report(facts_of(run)).to_markdown()
    run.ledger.record_event(dpsgd_event(B / N, SIGMA, 30), label="tuning")  # dpfy tune does this
    md = build_report(facts_of(run, tuning=TuningFacts("private", 3))).to_markdown()
    assert note in md.split("- target ε (budget guard)")[1].splitlines()[0]


def test_item_7_recorded_tuning_is_reported_with_the_total():
    run, _ = private_run()
    run.ledger.record_event(dpsgd_event(B / N, SIGMA, 30), label="tuning")
    card = build_report(facts_of(run, tuning=TuningFacts("private", 3)))
    eps = card.to_json()["epsilon"]
    by_label = run.ledger.epsilon_by_label()
    assert eps["tuning"] == by_label["tuning"] and eps["total"] == by_label["total"]
    assert eps["total"] > eps["training"] and eps["total"] > eps["tuning"]
    md = card.to_markdown()
    assert f"ε_tuning = {by_label['tuning']:.4g} from 1 tuning event(s)" in md
    assert f"**total: ε = {by_label['total']:.4g} at δ = 0.0001**" in md
    assert not any(f.code == "tuning-not-accounted" for f in card.findings)


def test_item_7_unaccounted_private_tuning_is_called_out(poisson):
    run, _ = poisson
    card = build_report(facts_of(run, tuning=TuningFacts("private", 12)))
    assert card.to_json()["epsilon"]["tuning_statement"].startswith("NOT ACCOUNTED: 12")
    assert any(f.code == "tuning-not-accounted" for f in card.findings)
    assert "error-level pitfall" in card.headline


def test_item_8_hyperparameter_table(poisson):
    _, facts = poisson
    card = build_report(facts)
    hyper = card.to_json()["hyperparameters"]
    assert hyper == {
        "dataset_size": N,
        "sampling_rate": pytest.approx(B / N),
        "expected_batch_size": B,
        "noise_multiplier": SIGMA,
        "max_grad_norm": C,
        "steps": STEPS,
        "epochs": pytest.approx(STEPS * B / N),
        "optimizer": "SGD",
        "learning_rate": LR,
        "microbatch_size": None,
        "loss_reduction": "mean",
        "sampler": "poisson",
    }
    md = card.to_markdown()
    for row in (
        "| training examples | N | 200 |",
        "| noise multiplier | σ | 1.3 |",
        "| clip norm | C | 0.7 |",
        "| epochs = T·B/N | E | 0.8 |",
        "| optimizer |  | SGD |",
        "| learning rate | η | 0.25 |",
    ):
        assert row in md


def test_item_9_software_versions_and_pitfalls_section(poisson):
    _, facts = poisson
    card = build_report(facts)
    software = card.to_json()["software"]
    assert software["torch"] == torch.__version__ and software["numpy"] == np.__version__
    assert software["dpfy"] == dpfy.__version__ and software["python"] == (
        ".".join(map(str, sys.version_info[:3]))
    )
    md = card.to_markdown()
    assert f"- torch {torch.__version__}" in md and "## Pitfalls" in md


def test_epsilon_table_has_pld_beside_rdp_at_standard_deltas(poisson):
    run, facts = poisson
    rows = build_report(facts).to_json()["epsilon_table"]["rows"]
    assert [r["delta"] for r in rows] == [1e-4, 1e-5, 1e-6, 1e-8]
    rdp = RdpAccountant().compose(dpsgd_event(B / N, SIGMA, STEPS))
    for row in rows:
        assert row["pld"] == pytest.approx(run.ledger.epsilon(row["delta"]), rel=1e-9)
        assert row["rdp"] == pytest.approx(rdp.epsilon(row["delta"]), rel=1e-9)
        assert row["pld"] < row["rdp"]


def test_every_registered_section_appears_in_both_forms(poisson):
    _, facts = poisson
    card = build_report(facts)
    data, md = card.to_json(), card.to_markdown()
    assert data["format"] == REPORT_FORMAT and data["version"] == 2
    for key, spec in SECTIONS.items():
        assert key in data and f"## {spec.title}" in md
    # the card meant for publication holds no un-noised statistic of the private data
    assert "diagnostics" not in data and "## Diagnostics" not in md
    assert "median" not in md and "0.93" not in md  # gradient norms, the non-private baseline
    assert "median" in render_diagnostics(facts)  # they are in the diagnostics file


def test_diagnostics_carry_accuracy_and_gradient_norm_statistics(poisson):
    _, facts = poisson
    diag = diagnostics_document(facts)
    assert diag["accuracy"] == 0.81 and diag["baseline_accuracy"] == 0.93
    assert diag["grad_norms"]["count"] > 0 and diag["grad_norms"]["max_grad_norm"] == C
    assert "outside the DP guarantee" in diag["not_for_publication"]
    assert build_report(facts).to_json()["results"]["accuracy"] == 0.81  # released: on the card


# -- JSON round trip ------------------------------------------------------------------------------


def test_json_round_trip_renders_identical_markdown(shuffled, tmp_path):
    _, facts = shuffled
    facts = dataclasses.replace(
        facts, tuning=TuningFacts("private", 4), dataset=dataclasses.replace(facts.dataset)
    )
    again = RunFacts.from_dict(json.loads(json.dumps(facts.to_dict(), allow_nan=False)))
    assert again == facts
    assert build_report(again).to_markdown() == build_report(facts).to_markdown()
    assert build_report(again).to_json() == build_report(facts).to_json()
    loaded = RunFacts.load(facts.save(tmp_path / "facts.json"))
    assert build_report(loaded).to_markdown() == build_report(facts).to_markdown()


def test_unbounded_epsilon_survives_strict_json():
    run, _ = private_run()
    facts = facts_of(run)
    summary = dataclasses.replace(
        facts.accounting.summary, epsilon={"training": math.inf, "total": math.inf}
    )
    accounting = dataclasses.replace(facts.accounting, summary=summary)
    facts = dataclasses.replace(facts, accounting=accounting)
    text = json.dumps(facts.to_dict(), allow_nan=False)
    again = RunFacts.from_dict(json.loads(text))
    assert again.accounting.summary.total_epsilon == math.inf
    assert "(∞, 0.0001)-DP" in build_report(again).to_markdown()
    json.dumps(build_report(again).to_json(), allow_nan=False)


def test_corrupt_or_foreign_facts_are_refused(poisson):
    _, facts = poisson
    data = facts.to_dict()
    with pytest.raises(ValueError, match=f"not version-{FACTS_VERSION} dpfy run facts"):
        RunFacts.from_dict({**data, "version": 99})
    with pytest.raises(ValueError, match=r"not version-2 dpfy run facts .*version=1\)"):
        RunFacts.from_dict({**data, "version": 1})  # facts.json before the typed summary
    with pytest.raises(ValueError, match="unknown TrainingFacts fields"):
        RunFacts.from_dict({**data, "training": {**data["training"], "secret": 1}})
    with pytest.raises(ValueError, match="malformed DatasetFacts"):
        RunFacts.from_dict({**data, "dataset": {"name": "x"}})


def test_report_renders_from_saved_facts_without_torch(poisson, tmp_path):
    # Loading rebuilds the ledger and recomputes every ε, all without torch.
    _, facts = poisson
    path = facts.save(tmp_path / "facts.json")
    script = (
        "import sys\n"
        "class NoTorch:\n"  # any torch import now fails (scipy still sees no torch loaded)
        "    def find_spec(self, name, *args):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('no torch here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from dpfy.report.facts import RunFacts\nfrom dpfy.report.render import build_report\n"
        f"sys.stdout.write(build_report(RunFacts.load({str(path)!r})).to_markdown())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout == build_report(facts).to_markdown()


# -- facts collection helpers ---------------------------------------------------------------------


def test_recorded_norms_are_the_engine_norms_and_the_engine_is_restored():
    run, norms = private_run()
    assert norms.size == run.ledger.summary().examples_seen
    assert "clip_and_accumulate" not in vars(run.engine)  # the wrapper is gone after the block
    assert np.all(norms >= 0)


def test_dataset_preprocessing_record_becomes_a_step():
    class Record:  # the shape of dpfy.data.preprocessing.Preprocessing
        steps = ("standardise", "clip outliers")
        fitted_on_private_data = True
        declared_public = False

    (step,) = preprocessing_steps(Record())
    assert step == PreprocessingStep(
        "standardise, clip outliers", "standardise; clip outliers", True, False
    )
    with pytest.raises(ValueError, match="PreprocessingStep"):
        preprocessing_steps(["standardise"])


# -- run directories and the JSON schema ----------------------------------------------------------

SCHEMA_KEYS = {
    "format",
    "version",
    "title",
    "headline",
    "dp_setting",
    "released",
    "unit_of_privacy",
    "neighbouring_relation",
    "accounting",
    "assumptions",
    "epsilon",
    "epsilon_table",
    "empirical_audit",
    "behaviour_checks",
    "hyperparameters",
    "software",
    "pitfalls",
    "run",
    "results",
}


def test_json_keys_are_the_documented_schema(poisson):
    _, facts = poisson
    data = build_report(facts).to_json()
    assert set(data) == SCHEMA_KEYS
    for key in SCHEMA_KEYS - {"format", "version", "title", "headline"}:
        assert f"    {key}:" in card_module.__doc__  # documented in the module docstring
    assert set(data["epsilon"]) == {
        "delta",
        "accountant",
        "training",
        "tuning",
        "tuning_statement",
        "other",
        "total",
        "target_epsilon",
        "assumptions_met",
        "under_poisson_assumption",
        "proven_total",
        "lower_bound",
        "statement",
    }


def test_shuffled_epsilon_lines_carry_the_unmet_assumption(shuffled):
    _, facts = shuffled
    md = build_report(facts).to_markdown()
    training = next(line for line in md.splitlines() if line.startswith("- training: ε ="))
    total = next(line for line in md.splitlines() if line.startswith("- **total: ε ="))
    assert training.endswith("(under the Poisson assumption, NOT met)")
    assert total.endswith("(under the Poisson assumption, NOT met)")


def test_write_report_fills_a_run_directory_that_renders_again(shuffled, tmp_path):
    _, facts = shuffled
    history = [{"step": s, "loss": 1.0 / s, "accuracy": 0.5} for s in range(1, STEPS + 1)]
    written = write_report(facts, tmp_path / "run", history=history)
    assert {p.name for p in (tmp_path / "run").iterdir()} == {
        "facts.json",
        "report.md",
        "report.json",
        "epsilon.png",
        "training.png",
        "diagnostics.md",
        "diagnostics.json",
        "diagnostics.png",
    }
    assert written["epsilon_plot"].read_bytes()[:4] == b"\x89PNG"
    assert render_run(tmp_path / "run") == written["markdown"].read_text(encoding="utf-8")
    assert render_run(tmp_path / "run", diagnostics=True) == written[
        "diagnostics_markdown"
    ].read_text(encoding="utf-8")
    assert render_run(tmp_path / "run", "md") == build_report(facts).to_markdown()
    assert json.loads(render_run(tmp_path / "run", "json")) == build_report(facts).to_json()
    with pytest.raises(ValueError, match="format must be one of md, json"):
        render(facts, "html")
    with pytest.raises(ValueError, match="does not exist"):
        render_run(tmp_path / "missing")
