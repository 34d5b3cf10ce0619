"""Noise is never replayed: every process that resumes a run draws fresh noise, and two
continuations of one checkpoint are two releases — the Python API spends twice, the CLI refuses
the second.

Replaying a checkpoint's noise stream in two continuations that differ in one record cancels the
noise in their difference and leaves the record's gradient in plain view; the same replay after a
rewind does the same with one run. Only noise a correlated mechanism already drew (DP-FTRL's tree
nodes) is restored: that is the stream continuing once, not a replay.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import dpfy
from dpfy.cli.app import app
from dpfy.jobs import loop
from dpfy.jobs.checkpoint import CHECKPOINT_FILE, STATUS_FILE
from dpfy.train.checkpoints import FORMAT, state_digest, unseal

WIDTH, CLASSES, BATCH, SIGMA, LR = 100, 4, 8, 1.0, 1.0
#: The std of one coordinate of one step's noise on the update: lr·σC/B (C = 1).
NOISE_STD = LR * SIGMA / BATCH
KINDS = {"unseeded": {}, "seeded": {"seed": 11}, "secure": {"secure_noise": True}}


def data(n: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, WIDTH, generator=generator), torch.arange(n) % CLASSES)


class Silent(nn.Module):
    """Every per-example gradient is exactly zero: an update is the step's noise alone, whatever
    the batch (a secure run's batches come from the OS and differ between continuations)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 0.0


def session(silent: bool = True, **options) -> dpfy.PrivateTraining:
    """A fresh run with plain SGD (lr 1): an update is −(clipped mean + noise) / B."""
    torch.manual_seed(0)
    net = Silent() if silent else nn.Linear(WIDTH, CLASSES)
    settings = dict(batch_size=BATCH, delta=1e-5, max_grad_norm=1.0, noise_multiplier=SIGMA,
                    steps=12)  # fmt: skip
    settings.update(options)
    return dpfy.make_private(net, torch.optim.SGD(net.parameters(), lr=LR), data(), **settings)


def flat(private: dpfy.PrivateTraining) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in private.model.parameters()])


def step(private: dpfy.PrivateTraining, batch) -> None:
    x, y = batch
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y).backward()
    private.optimizer.step()


def next_update(private: dpfy.PrivateTraining) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The next step's batch and the change it makes to the parameters."""
    batch = next(iter(private.loader))
    before = flat(private)
    step(private, batch)
    return flat(private) - before, batch


def trained(private: dpfy.PrivateTraining, steps: int) -> dpfy.PrivateTraining:
    for _ in range(steps):
        step(private, next(iter(private.loader)))
    return private


def noise_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """std(a − b) over the std two independent noise draws would give it: ≈ 1 when independent,
    0 when the same noise was drawn twice (the updates hold nothing but noise)."""
    return float((a - b).double().pow(2).mean().sqrt()) / (math.sqrt(2) * NOISE_STD)


def same_batches(first, second, kind: str = "seeded") -> bool:
    """The two steps saw the same data (sampling state is restored; a secure run samples anew)."""
    if kind == "secure":
        return True
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


# -- the Python API ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_continuations_of_one_checkpoint_draw_independent_noise(tmp_path, kind):
    path = trained(session(**KINDS[kind]), 3).save(tmp_path / "ckpt.pt")
    first, second = session(**KINDS[kind]), session(**KINDS[kind])
    first.load(path)
    second.load(path)
    torch.testing.assert_close(flat(first), flat(second), rtol=0, atol=0)  # same model ...
    one, batch_one = next_update(first)
    two, batch_two = next_update(second)
    assert same_batches(batch_one, batch_two, kind)  # ... same data: only the noise can differ
    assert 0.85 < noise_ratio(one, two) < 1.15
    # Two releases: the API does not refuse the second, and each spends what it trained.
    assert first.ledger.steps == second.ledger.steps == 4


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_continuation_never_redraws_the_noise_the_run_drew_after_its_checkpoint(tmp_path, kind):
    original = trained(session(**KINDS[kind]), 3)
    path = original.save(tmp_path / "ckpt.pt")
    uninterrupted, batch = next_update(original)  # what the run itself drew at step 4
    resumed = session(**KINDS[kind])
    resumed.load(path)
    again, same = next_update(resumed)
    assert same_batches(batch, same, kind)
    assert 0.85 < noise_ratio(uninterrupted, again) < 1.15


def test_a_continuation_in_the_same_session_draws_fresh_noise_too():
    private = trained(session(seed=3), 2)
    state = copy.deepcopy(private.state_dict())
    first, batch = next_update(private)
    private.load_state_dict(state)  # the same checkpoint, loaded twice into one session
    private.load_state_dict(state)
    again, same = next_update(private)
    assert same_batches(batch, same)
    assert 0.85 < noise_ratio(first, again) < 1.15


_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_resume_fresh_noise import session, trained, next_update
path = {path!r}
trained(session(seed=11), 3).save(path)
resumed = session(seed=11)
resumed.load(path)
update, _ = next_update(resumed)
torch.save(update, path + ".update")
"""


def test_a_seeded_resume_is_reproducible_in_a_new_process_yet_never_the_saved_stream(tmp_path):
    updates = []
    for attempt in range(2):
        path = str(tmp_path / f"ckpt{attempt}.pt")
        script = _SCRIPT.format(tests=str(Path(__file__).parent), path=path)
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
        updates.append(torch.load(path + ".update", weights_only=True))
    torch.testing.assert_close(updates[0], updates[1], rtol=0, atol=0)  # an experiment replays
    uninterrupted, _ = next_update(trained(session(seed=11), 3))
    assert 0.85 < noise_ratio(uninterrupted, updates[0]) < 1.15  # but not the run's own stream


def test_a_checkpoint_holds_no_noise_generator_state(tmp_path):
    private = trained(session(seed=2), 2)
    assert "noise" not in unseal(private.state_dict())
    saved = torch.load(private.save(tmp_path / "ckpt.pt"), weights_only=True)
    assert "noise" not in saved


def test_an_older_checkpoint_with_noise_state_loads_and_its_noise_is_not_replayed(tmp_path):
    original = trained(session(seed=4), 3)
    body = {k: v for k, v in unseal(copy.deepcopy(original.state_dict())).items()
            if k not in ("format", "version")}  # fmt: skip
    older = {"format": FORMAT, "version": 3, **body, "noise": original.noise.state_dict()}
    torch.save({**older, "digest": state_digest(older)}, tmp_path / "v3.pt")
    uninterrupted, batch = next_update(original)
    resumed = session(seed=4)
    resumed.load(tmp_path / "v3.pt")
    assert resumed.ledger.steps == 3 and resumed.run_id == original.run_id
    again, same = next_update(resumed)
    assert same_batches(batch, same)
    assert 0.85 < noise_ratio(uninterrupted, again) < 1.15


def test_a_noise_source_that_cannot_draw_a_fresh_stream_is_refused_at_resume(tmp_path):
    path = trained(session(seed=4), 2).save(tmp_path / "ckpt.pt")
    resumed = session(seed=4)

    class Replaying:
        def normal(self, like, std):
            return torch.zeros_like(like)

    resumed.optimizer.noise = Replaying()
    before = flat(resumed)
    with pytest.raises(ValueError, match="fresh"):
        resumed.load(path)
    assert torch.equal(flat(resumed), before) and resumed.ledger.steps == 0


class ZeroNoise:
    """Adds nothing: what is left of the noise is what the tree already held."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


def test_dp_ftrl_resumes_its_tree_exactly_and_draws_only_the_new_nodes_fresh(tmp_path):
    whole = trained(session(silent=False, algorithm="dp-ftrl", seed=5), 5)  # 101₂: two nodes
    path = whole.save(tmp_path / "ckpt.pt")
    held = copy.deepcopy(whole.optimizer.mechanism.state_dict())
    first, second = (session(silent=False, algorithm="dp-ftrl", seed=5) for _ in range(2))
    first.load(path)
    second.load(path)
    for resumed in (first, second):
        state = resumed.optimizer.mechanism.state_dict()
        assert state["steps_done"] == held["steps_done"] == 5
        stack, saved = state["tree"]["stack"], held["tree"]["stack"]
        assert [level for level, _ in stack] == [level for level, _ in saved] == [2, 0]
        for (_, mine), (_, theirs) in zip(stack, saved, strict=True):
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        assert all(torch.equal(state["released"][k], v) for k, v in held["released"].items())
    one, batch = next_update(first)
    two, same = next_update(second)
    assert same_batches(batch, same)
    assert not torch.allclose(one, two)  # the new leaf is fresh in each continuation
    # With fresh noise silenced, every later prefix sum still carries the nodes drawn before the
    # checkpoint: the continuation goes on exactly as the uninterrupted run does.
    whole.optimizer.noise = ZeroNoise()
    resumed = session(silent=False, algorithm="dp-ftrl", seed=5)
    resumed.load(path)
    resumed.optimizer.noise = ZeroNoise()
    trained(whole, 7)
    trained(resumed, 7)
    torch.testing.assert_close(flat(resumed), flat(whole), rtol=0, atol=0)
    assert resumed.ledger.steps == whole.ledger.steps == 12
    assert resumed.epsilon() == whole.epsilon()


# -- the CLI -------------------------------------------------------------------------------------

#: Digits, logistic regression, one epoch: 12 steps, a checkpoint after each.
QUICK = ["train", "--model", "logreg", "--epochs", "1"]
STEPS = 12
_STEP = loop._step


def dpfy_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def contents(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def ctrl_c_at(monkeypatch):
    """Make the n-th private step of the next command deliver Ctrl-C (inside it: mid_step)."""

    def arm(step: int, *, mid_step: bool = False) -> None:
        count = {"n": 0}

        def step_then_signal(private, x, y):
            count["n"] += 1
            if count["n"] == step:
                if mid_step:
                    raise KeyboardInterrupt
                os.kill(os.getpid(), signal.SIGINT)
            return _STEP(private, x, y)

        monkeypatch.setattr(loop, "_step", step_then_signal)

    return arm


def test_the_cli_resumes_a_checkpoint_once_and_refuses_the_second(tmp_path, ctrl_c_at):
    out = tmp_path / "run"
    ctrl_c_at(3)
    assert dpfy_cli(*QUICK, "--out", str(out))[0] == 130
    consumed = (out / CHECKPOINT_FILE).read_bytes()
    ctrl_c_at(1, mid_step=True)  # the continuation stops inside its first step: no new checkpoint
    code, _, stderr = dpfy_cli("train", "--resume", str(out))
    assert code == 130, stderr
    assert (out / CHECKPOINT_FILE).read_bytes() == consumed
    assert "cannot be resumed" in stderr and "--resume" not in stderr  # it says so, at once
    assert "resume" not in json.loads((out / STATUS_FILE).read_text())
    assert "cannot be resumed" in (out / "report.md").read_text().splitlines()[0]
    before = contents(out)
    code, _, stderr = dpfy_cli("train", "--resume", str(out))
    assert code == 2
    line = one_error_line(stderr)
    assert "already resumed" in line and "second release" in line and "new run" in line
    assert contents(out) == before  # refused before anything in the directory changed


def test_a_copy_of_a_resumed_checkpoint_put_back_is_refused(tmp_path, ctrl_c_at):
    out = tmp_path / "run"
    ctrl_c_at(3)
    assert dpfy_cli(*QUICK, "--out", str(out))[0] == 130
    kept = (out / CHECKPOINT_FILE).read_bytes()
    status = (out / STATUS_FILE).read_bytes()
    ctrl_c_at(2)  # the continuation writes checkpoints of its own, then stops
    assert dpfy_cli("train", "--resume", str(out))[0] == 130
    (out / CHECKPOINT_FILE).write_bytes(kept)  # back to the checkpoint already continued once
    (out / STATUS_FILE).write_bytes(status)
    code, _, stderr = dpfy_cli("train", "--resume", str(out))
    assert code == 2 and "already resumed" in one_error_line(stderr)


def test_resume_interrupt_resume_continues_from_the_continuations_checkpoint(tmp_path, ctrl_c_at):
    out = tmp_path / "run"
    ctrl_c_at(3)
    assert dpfy_cli(*QUICK, "--out", str(out))[0] == 130
    ctrl_c_at(3)  # steps 4, 5, 6, then Ctrl-C: a checkpoint at step 6
    code, _, stderr = dpfy_cli("train", "--resume", str(out))
    assert code == 130, stderr
    assert json.loads((out / STATUS_FILE).read_text())["steps_taken"] == 6
    ctrl_c_at(STEPS + 1)  # never: the last continuation runs to the end
    code, stdout, stderr = dpfy_cli("train", "--resume", str(out), "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["resumed_at"] == 6
    facts = json.loads((out / "facts.json").read_text())
    assert facts["training"]["steps_taken"] == STEPS
    assert json.loads((out / STATUS_FILE).read_text())["status"] == "finished"


@pytest.mark.parametrize("resumable", [True, False])
def test_the_json_of_an_interrupted_run_offers_a_resume_only_when_one_is_allowed(
    resumable, tmp_path, capsys
):
    from dpfy.cli.train_output import Output, print_interrupted
    from dpfy.jobs.outcome import Interrupted

    stop = Interrupted(tmp_path, 3, 10, 0.5, 1e-5, checkpointed=True, resumable=resumable)
    print_interrupted(stop, Output.json)
    resume = json.loads(capsys.readouterr().out)["resume"]
    assert (resume == f"dpfy train --resume {tmp_path}") if resumable else resume is None
