"""`dpfy train --resume RUN_DIR` and Ctrl-C: an interrupted run leaves a checkpoint and a report of
what it spent, and the resumed run spends what the uninterrupted one would have (with noise of its
own: a resume never replays the noise the interrupted run drew)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.jobs import loop
from dpfy.jobs.checkpoint import CHECKPOINT_FILE, STATUS_FILE, write_status

#: Digits, logistic regression, one epoch: 12 steps, a checkpoint after each.
QUICK = ["train", "--model", "logreg", "--epochs", "1"]
STEPS = 12


def dpfy(*args: str) -> tuple[int, str, str]:
    """Run the CLI in-process: exit code, stdout, stderr."""
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    """The only non-empty stderr line, which must be an `error:` line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def facts(run_dir: Path) -> dict:
    return json.loads((run_dir / "facts.json").read_text())


def spent(run_dir: Path) -> dict:
    """The run's accounting: its ledger's entries and summary (not the run's own identity)."""
    accounting = facts(run_dir)["accounting"]
    ledger = {k: v for k, v in accounting["ledger_state"].items() if k != "run_id"}
    return {"ledger": ledger, "summary": accounting["summary"]}


@pytest.fixture
def ctrl_c_at(monkeypatch):
    """Make the n-th private step deliver a real SIGINT to this process while it runs."""

    def arm(step: int, *, mid_step: bool = False) -> None:
        real = loop._step
        count = {"n": 0}

        def step_then_signal(private, x, y):
            count["n"] += 1
            if count["n"] == step:
                if mid_step:  # a second Ctrl-C, or one no handler deferred: inside the step
                    raise KeyboardInterrupt
                os.kill(os.getpid(), signal.SIGINT)
            return real(private, x, y)

        monkeypatch.setattr(loop, "_step", step_then_signal)

    return arm


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The same seeded run, never interrupted: what a resumed run must spend in all."""
    out = tmp_path_factory.mktemp("whole") / "run"
    code, _, stderr = dpfy(*QUICK, "--seed", "7", "--out", str(out))
    assert code == 0, stderr  # a seeded run is a WARN (an experiment): exit 0 unless --strict
    return out


def test_ctrl_c_leaves_a_checkpoint_and_a_report_of_what_was_spent_and_exits_130(
    tmp_path, ctrl_c_at
):
    out = tmp_path / "run"
    ctrl_c_at(5)
    code, _, stderr = dpfy(*QUICK, "--out", str(out))
    assert code == 130, stderr
    assert f"dpfy train --resume {out}" in stderr and "Traceback" not in stderr
    assert (out / CHECKPOINT_FILE).is_file()
    assert stat.S_IMODE((out / CHECKPOINT_FILE).stat().st_mode) == 0o600  # holds the sampler RNG
    status = json.loads((out / STATUS_FILE).read_text())
    assert status["status"] == "interrupted" and status["steps_taken"] == 5
    report = (out / "report.md").read_text()
    assert report.startswith("> **Interrupted** after 5 of 12 planned steps")
    assert f"dpfy train --resume {out}" in report.splitlines()[0]
    assert facts(out)["accounting"]["summary"]["steps"] == 5  # what was spent, not the plan
    assert not (out / "model.pt").exists()


def test_the_resumed_run_spends_as_the_uninterrupted_one(tmp_path, ctrl_c_at, uninterrupted):
    out = tmp_path / "run"
    ctrl_c_at(5)
    assert dpfy(*QUICK, "--seed", "7", "--out", str(out))[0] == 130
    code, stdout, stderr = dpfy("train", "--resume", str(out), "--json")
    assert code == 0, stderr  # seeded (a WARN), like the run it continues
    result = json.loads(stdout)
    whole = facts(uninterrupted)
    resumed = facts(out)
    assert resumed["accounting"]["summary"]["steps"] == STEPS == whole["training"]["steps_taken"]
    assert spent(out) == spent(uninterrupted)  # the ledger went on, not over again
    assert result["resumed_at"] == 5 and result["steps"] == STEPS
    # Not the same accuracy: every resume draws fresh noise, even a seeded one (a replayed stream
    # would let two continuations of one checkpoint cancel it in their difference), so steps 6-12
    # differ from the uninterrupted run's; what they spent is the same.
    assert resumed["results"]["accuracy"] is not None
    assert not (out / CHECKPOINT_FILE).exists()  # its random state does not outlive the run
    assert json.loads((out / STATUS_FILE).read_text())["status"] == "finished"
    assert not (out / "report.md").read_text().startswith("> **Interrupted**")


def test_an_interrupt_inside_a_step_resumes_from_the_last_periodic_checkpoint(
    tmp_path, ctrl_c_at, uninterrupted
):
    out = tmp_path / "run"
    ctrl_c_at(6, mid_step=True)  # step 6 never finishes: the checkpoint of step 5 stands
    code, _, stderr = dpfy(*QUICK, "--seed", "7", "--out", str(out))
    assert code == 130 and "last periodic checkpoint" in stderr, stderr
    assert facts(out)["results"]["accuracy"] is None  # that model is past the checkpoint
    code, stdout, _ = dpfy("train", "--resume", str(out), "--json")
    assert json.loads(stdout)["resumed_at"] == 5
    assert spent(out) == spent(uninterrupted)
    # The accuracy is not the uninterrupted run's: the resume drew fresh noise for steps 6-12.
    assert facts(out)["results"]["accuracy"] is not None


def test_an_unseeded_resumed_run_takes_exactly_the_planned_steps(tmp_path, ctrl_c_at):
    out = tmp_path / "run"
    ctrl_c_at(3)
    assert dpfy(*QUICK, "--out", str(out))[0] == 130
    code, stdout, stderr = dpfy("train", "--resume", str(out))
    assert code == 0, stderr
    assert "resumed at step 3" in stdout
    assert facts(out)["training"]["steps_taken"] == STEPS


def test_resume_refuses_options_that_differ_from_the_saved_run(tmp_path, ctrl_c_at):
    out = tmp_path / "run"
    ctrl_c_at(3)
    assert dpfy(*QUICK, "--out", str(out))[0] == 130
    code, _, stderr = dpfy("train", "--resume", str(out), "--epochs", "5", "--lr", "0.01")
    assert code == 2
    line = one_error_line(stderr)
    assert "--epochs 5.0 (saved: 1.0)" in line and "--lr" not in line  # equal values pass
    assert f"--config {out / 'config.json'}" in line
    assert json.loads((out / STATUS_FILE).read_text())["status"] == "interrupted"  # untouched


def test_resume_refuses_a_finished_run_and_a_directory_without_checkpoint(tmp_path):
    done = tmp_path / "done"
    assert dpfy(*QUICK, "--epochs", "0.2", "--out", str(done))[0] == 0
    code, _, stderr = dpfy("train", "--resume", str(done))
    assert code == 2 and "holds no checkpoint to resume" in one_error_line(stderr)
    (tmp_path / "empty").mkdir()
    code, _, stderr = dpfy("train", "--resume", str(tmp_path / "empty"))
    assert code == 2 and "holds no config.json" in one_error_line(stderr)


def test_resume_refuses_a_run_a_live_process_still_trains(tmp_path, ctrl_c_at):
    out = tmp_path / "run"
    ctrl_c_at(3)
    assert dpfy(*QUICK, "--out", str(out))[0] == 130
    write_status(out, "running", 3, STEPS)  # this very process: alive
    code, _, stderr = dpfy("train", "--resume", str(out))
    assert code == 2 and f"being trained by process {os.getpid()}" in one_error_line(stderr)


def test_a_new_run_into_an_interrupted_directory_is_refused_naming_resume(tmp_path, ctrl_c_at):
    out = tmp_path / "run"
    ctrl_c_at(3)
    assert dpfy(*QUICK, "--out", str(out))[0] == 130
    code, _, stderr = dpfy(*QUICK, "--out", str(out))
    assert code == 2 and f"`dpfy train --resume {out}` continues it" in one_error_line(stderr)


def test_a_run_that_died_after_its_last_step_resumes_to_its_report_without_a_step_more(
    tmp_path, monkeypatch, uninterrupted
):
    from dpfy.jobs import outcome

    out = tmp_path / "run"

    def die(*args, **kwargs):
        raise RuntimeError("the machine went down")

    with monkeypatch.context() as patch:
        patch.setattr(outcome, "finished", die)
        with pytest.raises(RuntimeError):
            CliRunner().invoke(app, [*QUICK, "--seed", "7", "--out", str(out)],
                               catch_exceptions=False)  # fmt: skip
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    status = json.loads((out / STATUS_FILE).read_text())
    write_status(out, "running", status["steps_taken"], STEPS)
    document = json.loads((out / STATUS_FILE).read_text())
    (out / STATUS_FILE).write_text(json.dumps({**document, "pid": int(dead.stdout)}))
    code, stdout, stderr = dpfy("train", "--resume", str(out), "--json")
    assert code == 0, stderr  # seeded: a WARN
    assert json.loads(stdout)["resumed_at"] == STEPS
    assert spent(out) == spent(uninterrupted)
    assert facts(out)["results"]["accuracy"] == facts(uninterrupted)["results"]["accuracy"]
