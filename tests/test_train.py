"""`dpfy train` end to end: the run directory, the report, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.plan.accounting import PldAccountant, dpsgd_event


def dpfy_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m dpfy ARGS`` as a shell runs it."""
    return subprocess.run(
        [sys.executable, "-m", "dpfy", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "120"},
    )


def dpfy(*args: str) -> subprocess.CompletedProcess[str]:
    """``dpfy ARGS`` in this process (no interpreter start or torch import per call)."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "120"})
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """Digits, the default model, 3 epochs, with a baseline."""
    run_dir = tmp_path_factory.mktemp("runs") / "digits"
    run = dpfy_process("train", "--epochs", "3", "--out", str(run_dir), "--baseline")
    return run_dir, run


def test_train_writes_a_complete_run_directory(short_run):
    run_dir, run = short_run
    assert run.returncode == 0, run.stderr
    for name in ("report.md", "report.json", "facts.json", "history.json", "model.pt",
                 "epsilon.png", "training.png", "diagnostics.md", "diagnostics.json",
                 "diagnostics.png"):  # fmt: skip
        assert (run_dir / name).is_file(), name
    assert (run_dir / "epsilon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "test accuracy (non-private)" in run.stdout


def test_report_states_the_accounted_epsilon_and_accuracies(short_run):
    run_dir, _ = short_run
    report = json.loads((run_dir / "report.json").read_text())
    facts = json.loads((run_dir / "facts.json").read_text())
    privacy = facts["privacy"]
    expected = (
        PldAccountant()
        .compose(
            dpsgd_event(privacy["sampling_rate"], privacy["noise_multiplier"], privacy["steps"])
        )
        .epsilon(privacy["delta"])
    )
    assert report["epsilon"]["total"] == pytest.approx(expected, rel=1e-9)
    assert expected <= 3.0
    assert privacy["delta"] == 1e-5 and privacy["delta"] < 1 / privacy["dataset_size"]
    assert 0.5 < report["results"]["accuracy"] <= 1.0  # held-out accuracy: on the card
    assert "diagnostics" not in report  # the baseline is an un-noised diagnostic, not published
    diagnostics = json.loads((run_dir / "diagnostics.json").read_text())
    assert 0.5 < diagnostics["accuracy"] <= 1.0
    assert 0.5 < diagnostics["baseline_accuracy"] <= 1.0


def test_default_run_draws_sampling_and_noise_from_os_entropy(short_run):
    run_dir, _ = short_run  # no --seed given
    facts = json.loads((run_dir / "facts.json").read_text())
    assert facts["privacy"]["seeded"] is False
    pitfalls = json.loads((run_dir / "report.json").read_text())["pitfalls"]
    assert "seeded-randomness" not in [p["code"] for p in pitfalls]


def test_report_rerenders_from_the_run_directory(short_run):
    run_dir, _ = short_run
    markdown = dpfy("report", str(run_dir))
    assert markdown.returncode == 0, markdown.stderr
    assert markdown.stdout.strip() == (run_dir / "report.md").read_text().strip()
    as_json = dpfy("report", str(run_dir), "--format", "json")
    assert json.loads(as_json.stdout) == json.loads((run_dir / "report.json").read_text())
    diagnostics = dpfy("report", str(run_dir), "--diagnostics")
    assert diagnostics.stdout.strip() == (run_dir / "diagnostics.md").read_text().strip()


def test_an_existing_run_is_never_overwritten(short_run):
    run_dir, _ = short_run
    before = (run_dir / "report.md").read_bytes()
    again = dpfy("train", "--epochs", "1", "--out", str(run_dir))
    assert again.returncode == 2
    assert "already holds a finished run" in again.stderr and "Traceback" not in again.stderr
    assert (run_dir / "report.md").read_bytes() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "cifar-100"], "digits"),
        (["--model", "resnet"], "mlp"),
        (["--dataset", "fashion-mnist", "--data-dir", "EMPTY"], "dataset-fashion-mnist"),
        (["--target-epsilon", "1e-9", "--delta", "1e-12"], "raise the target"),
        (["--delta", "1.5"], "delta"),
        (["--batch-size", "5000"], "batch_size"),
        (["--out", "/proc/dpfy-cannot-write-here"], "cannot write"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, message):
    args = [str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    (tmp_path / "empty").mkdir()
    if "--out" not in args:
        args += ["--out", str(tmp_path / "run")]
    run = dpfy("train", "--epochs", "1", *args)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_report_of_a_directory_without_a_run_is_refused(tmp_path):
    run = dpfy("report", str(tmp_path))
    assert run.returncode == 2 and "no facts.json" in run.stderr
