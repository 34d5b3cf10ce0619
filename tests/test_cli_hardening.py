"""Hardening of the CLI: run directories are claimed, never shared or overwritten, and every
kind of bad input ends as one `error:` line on stderr with exit code 2 — never a traceback."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.data.idx import write_idx
from dpfy.jobs.run_dir import prepare_run_dir

#: The quickest real training run: digits, logistic regression, a fraction of an epoch.
QUICK = ["train", "--model", "logreg", "--epochs", "0.3"]
FEDERATED = [
    "federated", "--users", "20", "--clients-per-round", "5", "--rounds", "2",
    "--local-steps", "1", "--model", "logreg",
]  # fmt: skip


def dpfy(*args: str) -> tuple[int, str, str]:
    """Run the CLI in-process: exit code, stdout, stderr."""
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code: int, stderr: str, *needles: str) -> str:
    """Exit code 2, no traceback, and exactly one non-empty stderr line: the `error:` line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def listing(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes, to prove nothing changed."""
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# ------------------------------------------------------------------ item 13: run directories


def users_files(directory: Path) -> dict[str, bytes]:
    """A directory holding the user's own model.pt and report.md."""
    directory.mkdir()
    (directory / "model.pt").write_bytes(b"the user's own weights")
    (directory / "report.md").write_text("the user's own notes")
    return listing(directory)


@pytest.mark.parametrize(
    "command",
    [
        QUICK,
        FEDERATED,
        [
            "tune",
            "--tuning-accounting",
            "compose",
            "--epochs",
            "0.3",
            "--trial-epochs",
            "0.3",
            "--clip-grid",
            "1",
        ],
    ],
    ids=["train", "federated", "tune"],
)
def test_an_out_holding_the_users_own_files_is_refused_untouched(tmp_path, command):
    out = tmp_path / "mine"
    before = users_files(out)
    code, _, stderr = dpfy(*command, "--out", str(out))
    assert_one_line_error(code, stderr, str(out), "not empty", "model.pt", "--out")
    assert listing(out) == before


def test_a_directory_claimed_by_a_running_run_is_refused(tmp_path):
    out = prepare_run_dir(tmp_path / "shared")  # a first run has claimed it and is training
    code, _, stderr = dpfy(*QUICK, "--out", str(out))
    assert_one_line_error(code, stderr, "already claimed by another dpfy run", "--out")
    assert sorted(os.listdir(out)) == [".dpfy-run"]  # the second run wrote nothing


def test_of_runs_racing_for_one_directory_exactly_one_claims_it(tmp_path):
    target, racers = tmp_path / "race", 8
    start = threading.Barrier(racers)
    won: list[Path] = []
    refused: list[str] = []

    def race() -> None:
        start.wait()
        try:
            won.append(prepare_run_dir(target))
        except ValueError as err:
            refused.append(str(err))

    threads = [threading.Thread(target=race) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1 and len(refused) == racers - 1
    assert all("already claimed" in message for message in refused)


def test_a_finished_run_is_refused_by_a_second_run_on_the_same_out(tmp_path):
    out = tmp_path / "run"
    code, _, stderr = dpfy(*QUICK, "--out", str(out))
    assert code == 0, stderr
    before = listing(out)
    code, _, stderr = dpfy(*QUICK, "--out", str(out))
    assert_one_line_error(code, stderr, "already holds a finished run")
    assert listing(out) == before


def test_default_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda *_: "20250101-000000")  # one and the same second
    first = dpfy(*QUICK)
    second = dpfy(*QUICK)
    assert first[0] == 0 and second[0] == 0, first[2] + second[2]
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == ["digits-logreg-eps3-20250101-000000", "digits-logreg-eps3-20250101-000000-2"]
    assert all((tmp_path / "runs" / name / "report.json").is_file() for name in runs)


@pytest.mark.parametrize("command", [QUICK, FEDERATED], ids=["train", "federated"])
def test_an_empty_out_is_refused_instead_of_writing_into_the_working_directory(
    tmp_path, monkeypatch, command
):
    monkeypatch.chdir(tmp_path)
    code, _, stderr = dpfy(*command, "--out", "")
    assert_one_line_error(code, stderr, "--out is empty")
    assert os.listdir(tmp_path) == []


def test_a_run_refused_before_writing_leaves_no_directory_behind(tmp_path):
    out = tmp_path / "run"
    code, _, stderr = dpfy(*QUICK, "--dataset", "no-such-data", "--out", str(out))
    assert_one_line_error(code, stderr, "--dataset", "no-such-data", "is not one of")
    assert not out.exists()  # so the same --out works once the typo is fixed
    assert dpfy(*QUICK, "--out", str(out))[0] == 0


def test_an_existing_empty_out_directory_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    code, _, stderr = dpfy(*QUICK, "--out", str(out))
    assert code == 0, stderr
    assert {"report.md", "report.json", "facts.json", "model.pt", ".dpfy-run"} <= set(
        os.listdir(out)
    )


# ------------------------------------------------------------------ item 14: one-line errors


ACCOUNT = ["account", "--sampling-rate", "0.01", "--noise-multiplier", "1", "--delta", "1e-5"]
PLAN = ["plan", "--batch-size", "10", "--epochs", "1", "--target-epsilon", "1", "--delta", "1e-5"]


@pytest.mark.parametrize("steps", ["1e30", str(10**30)])
def test_account_with_an_astronomical_step_count_is_one_line(steps):
    code, _, stderr = dpfy(*ACCOUNT, "--steps", steps)
    assert_one_line_error(code, stderr, "--steps" if "e" in steps else "at most 1,000,000,000")


@pytest.mark.parametrize("size", ["1e30", str(10**30), str(10**400)])
def test_plan_with_an_astronomical_dataset_size_is_one_line(size):
    code, _, stderr = dpfy(*PLAN, "--dataset-size", size)
    assert_one_line_error(code, stderr, "--dataset-size")


def test_account_with_negligible_noise_says_once_that_epsilon_is_infinite():
    code, stdout, stderr = dpfy(
        "account", "--sampling-rate", "0.01", "--noise-multiplier", "1e-300", "--steps", "100",
        "--delta", "1e-5", "--accountant", "rdp", "--json",
    )  # fmt: skip
    assert code == 0, stderr
    assert json.loads(stdout)["epsilon"] is None  # JSON's spelling of an unbounded ε
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: ε is infinite"), stderr
    assert "--noise-multiplier" in lines[0]


def idx_dir(directory: Path, *, train_labels=None, n_test: int = 10) -> Path:
    """A tiny MNIST-style directory (40 train, ``n_test`` test images) under the standard names."""
    rng = np.random.default_rng(0)
    directory.mkdir()
    for prefix, n in (("train", 40), ("t10k", n_test)):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        if prefix == "train" and train_labels is not None:
            labels = train_labels
        write_idx(
            directory / f"{prefix}-images-idx3-ubyte.gz",
            rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        )
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory


def mnist(data_dir: Path, out: Path) -> tuple[int, str, str]:
    """A quick MNIST training run on ``data_dir``."""
    return dpfy(
        "train", "--dataset", "mnist", "--data-dir", str(data_dir), "--model", "logreg",
        "--batch-size", "8", "--epochs", "1", "--out", str(out),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("labels", "shown"),
    [
        (np.where(np.arange(40) == 3, -1, np.arange(40) % 10).astype(np.int8), "-1"),
        (np.where(np.arange(40) == 3, np.nan, np.arange(40) % 10).astype(np.float32), "nan"),
    ],
    ids=["minus-one", "nan"],
)
def test_mnist_labels_outside_the_classes_are_refused(tmp_path, labels, shown):
    data = idx_dir(tmp_path / "data", train_labels=labels)
    code, _, stderr = mnist(data, tmp_path / "run")
    assert_one_line_error(code, stderr, "train-labels-idx1-ubyte.gz", "0..9", shown, "restore")
    assert not (tmp_path / "run").exists()


def test_a_test_split_of_zero_images_is_refused_before_training(tmp_path):
    data = idx_dir(tmp_path / "data", n_test=0)
    code, _, stderr = mnist(data, tmp_path / "run")
    assert_one_line_error(code, stderr, "test split holds no examples")
    assert not (tmp_path / "run").exists()


def test_an_unreadable_data_file_is_named_with_the_fix(tmp_path, monkeypatch):
    data = idx_dir(tmp_path / "data")
    locked = data / "train-images-idx3-ubyte.gz"
    real_open = pathlib.Path.open

    def open_(self, *args, **kwargs):  # what the OS answers for a file without read permission
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    code, _, stderr = mnist(data, tmp_path / "run")
    assert_one_line_error(code, stderr, str(locked), "Permission denied", "permissions")


def test_a_garbage_data_file_is_named_with_the_fix(tmp_path):
    (tmp_path / "adult").mkdir()
    (tmp_path / "adult" / "adult.data").write_bytes(bytes(range(256)) * 8)
    code, _, stderr = dpfy(
        *QUICK, "--dataset", "adult", "--data-dir", str(tmp_path / "adult"),
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert_one_line_error(code, stderr, "adult.data", "not a UTF-8 text file", "adult.test")


def test_federated_with_an_overflowing_client_learning_rate_is_refused_up_front(tmp_path):
    code, _, stderr = dpfy(*FEDERATED, "--client-lr", "1e308", "--out", str(tmp_path / "run"))
    assert_one_line_error(code, stderr, "client_lr", "at most", "lower it")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "command",
    [QUICK, FEDERATED, ["tune", "--tuning-accounting", "compose"]],
    ids=["train", "federated", "tune"],
)
@pytest.mark.parametrize("seed", [str(2**70), "-1"])
def test_a_seed_outside_64_bits_is_refused_with_the_valid_range(tmp_path, command, seed):
    code, _, stderr = dpfy(*command, "--seed", seed, "--out", str(tmp_path / "run"))
    assert_one_line_error(code, stderr, "seed", "2**63 - 1", seed)
    assert not (tmp_path / "run").exists()


def test_tune_with_a_billion_trial_epochs_is_refused_at_once(tmp_path):
    run = subprocess.run(  # a subprocess: today's code would train for ever
        [sys.executable, "-m", "dpfy", "tune", "--tuning-accounting", "compose",
         "--trial-epochs", "1e9", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_one_line_error(run.returncode, run.stderr, "trial_epochs", "at most 10000")
    assert not (tmp_path / "run").exists()
