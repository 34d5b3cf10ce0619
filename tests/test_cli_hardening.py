"""Hardening of the CLI: run directories are claimed, never shared or overwritten."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli import app
from dpfy.trainer import prepare_run_dir

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
    assert_one_line_error(code, stderr, "unknown dataset")
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
