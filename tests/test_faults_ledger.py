"""Issue 35, item 2: a session that loads another run's checkpoint keeps what it already spent —
ε never goes down when a checkpoint is loaded, whoever wrote it."""

from __future__ import annotations

import pytest
from tests.test_private_step_paths import run, step

from dpfy.train.session import SPENT_BEFORE_LOAD


def steps(private, n: int) -> None:
    batches = iter(private.loader)
    for _ in range(n):
        step(private, next(batches))


@pytest.mark.parametrize("algorithm", ["dp-sgd", "dp-ftrl"])
def test_loading_another_runs_checkpoint_keeps_what_the_session_spent(tmp_path, algorithm):
    other = run(seed=1, algorithm=algorithm)
    steps(other, 2)
    other.save(tmp_path / "other.pt")
    other_epsilon = other.epsilon()

    session = run(seed=2, algorithm=algorithm)
    steps(session, 4)
    spent = session.epsilon()
    session.load(tmp_path / "other.pt")
    assert session.epsilon() >= max(spent, other_epsilon)
    assert session.epsilon() > other_epsilon  # the 4 steps of its own are still charged
    labels = session.ledger.epsilon_by_label()
    assert SPENT_BEFORE_LOAD in labels and labels[SPENT_BEFORE_LOAD] == pytest.approx(spent)


def test_a_fresh_session_loading_another_runs_checkpoint_charges_nothing_extra(tmp_path):
    other = run(seed=1)
    steps(other, 2)
    other.save(tmp_path / "other.pt")
    session = run(seed=2)
    session.load(tmp_path / "other.pt")
    assert session.epsilon() == pytest.approx(other.epsilon())
    assert SPENT_BEFORE_LOAD not in session.ledger.epsilon_by_label()
