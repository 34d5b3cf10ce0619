"""Issue 35, items 3 and 6: audits of one run take turns and merge (never lost), are refused while
the run trains, keep an interrupted run's banner; SIGTERM stops a run like Ctrl-C; a stale
running status names host and PID and `--force` takes it over; a failed resume leaves the run
interrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.jobs import loop
from dpfy.jobs.audit import lock_for_audit
from dpfy.jobs.checkpoint import STATUS_FILE, read_status, write_status
from dpfy.jobs.run_lock import audit_in_progress

QUICK = ["train", "--model", "logreg", "--epochs", "1"]
AUDIT = ["--canaries", "20", "--blocks", "5", "--seed", "0", "--method", "one-run"]


def dpfy(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory) -> Path:
    """A run stopped by SIGTERM after 3 of its 12 steps (in-process, the signal delivered)."""
    out = tmp_path_factory.mktemp("term") / "run"
    real = loop._step
    count = {"n": 0}

    def step_then_term(private, x, y):
        count["n"] += 1
        if count["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(private, x, y)

    loop._step = step_then_term
    try:
        code, _, stderr = dpfy(*QUICK, "--out", str(out))
    finally:
        loop._step = real
    assert code == 130, stderr
    return out


def test_sigterm_stops_a_run_like_ctrl_c(interrupted_run):
    status = json.loads((interrupted_run / STATUS_FILE).read_text())
    assert status["status"] == "interrupted" and status["steps_taken"] == 3
    assert (interrupted_run / "checkpoint.pt").is_file()
    assert (interrupted_run / "report.md").read_text().startswith("> **Interrupted**")


def test_an_audit_keeps_the_interrupted_banner(interrupted_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    code, _, stderr = dpfy("audit", str(run), *AUDIT)
    assert code == 0, stderr
    assert (run / "report.md").read_text().startswith("> **Interrupted**")
    assert len(json.loads((run / "facts.json").read_text())["audits"]) == 1


def test_an_audit_is_refused_while_the_run_trains(interrupted_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        status = json.loads((run / STATUS_FILE).read_text())
        status.update(status="running", pid=sleeper.pid)
        (run / STATUS_FILE).write_text(json.dumps(status))
        before = (run / "facts.json").read_bytes()
        code, _, stderr = dpfy("audit", str(run), *AUDIT)
        line = one_error_line(stderr)
        assert code == 2 and f"being trained by process {sleeper.pid}" in line
        assert (run / "facts.json").read_bytes() == before
    finally:
        sleeper.kill()
        sleeper.wait()


def test_two_audits_at_once_take_turns_and_both_results_are_kept(interrupted_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    held = lock_for_audit(run)  # an audit under way
    assert audit_in_progress(run) is not None
    results: dict[str, tuple[int, str, str]] = {}
    audits = [
        threading.Thread(target=lambda k=k: results.update({k: dpfy("audit", str(run), *AUDIT)}))
        for k in "ab"
    ]
    for audit in audits:
        audit.start()
    time.sleep(1.0)
    assert all(audit.is_alive() for audit in audits)  # both wait for the one under way
    held.release()
    for audit in audits:
        audit.join(120)
    assert [results[k][0] for k in "ab"] == [0, 0], results
    facts = json.loads((run / "facts.json").read_text())
    assert len(facts["audits"]) == 2
    assert len(json.loads((run / "audit.json").read_text())["audits"]) == 2


def test_a_resume_is_refused_while_an_audit_writes_to_the_run(interrupted_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    with lock_for_audit(run):
        code, _, stderr = dpfy("train", "--resume", str(run))
    assert code == 2 and "is being audited by process" in one_error_line(stderr)
    assert read_status(run)["status"] == "interrupted"


def test_a_read_only_run_directory_is_one_line_for_audit(interrupted_run, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    run.chmod(0o555)
    try:
        code, _, stderr = dpfy("audit", str(run), *AUDIT)
    finally:
        run.chmod(0o755)
    assert code == 2 and "cannot write to" in one_error_line(stderr)


def test_a_status_naming_another_host_names_it_and_the_force_override(interrupted_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    status = json.loads((run / STATUS_FILE).read_text())
    status.update(status="running", host="node-17", pid=4242)
    (run / STATUS_FILE).write_text(json.dumps(status))
    code, _, stderr = dpfy("train", "--resume", str(run))
    line = one_error_line(stderr)
    assert code == 2 and "process 4242 on node-17" in line and "--force" in line
    assert read_status(run)["host"] == "node-17"  # nothing changed
    code, _, stderr = dpfy("train", "--resume", str(run), "--force")
    assert code == 0, stderr
    assert read_status(run)["status"] == "finished"


def test_force_without_resume_is_refused():
    code, _, stderr = dpfy(*QUICK, "--force")
    assert code == 2 and "--force goes with --resume" in one_error_line(stderr)


def test_a_failed_resume_leaves_the_run_interrupted(interrupted_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    code, _, stderr = dpfy("train", "--resume", str(run))
    assert code == 2 and "corrupt" in one_error_line(stderr)
    assert read_status(run)["status"] == "interrupted"


def test_a_failed_run_status_is_recorded_by_write_status(tmp_path):
    write_status(tmp_path, "failed", 3, 12, error="disk full")
    assert read_status(tmp_path)["error"] == "disk full"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_an_unwritable_run_directory_is_one_line_before_the_audit_runs(
    interrupted_run, tmp_path, monkeypatch
):
    from dpfy.jobs import audit as audit_job

    run = tmp_path / "run"
    shutil.copytree(interrupted_run, run)
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).startswith(str(run)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(audit_job.os, "open", read_only)
    before = (run / "facts.json").read_bytes()
    code, _, stderr = dpfy("audit", str(run), *AUDIT)
    assert code == 2 and "cannot write to" in one_error_line(stderr)
    assert (run / "facts.json").read_bytes() == before
