"""The ledger is a record store and a budget guard behind one facade: the checkpoint format is
the one saved runs hold, and a changed target re-arms the guard instead of trusting its caches."""

from __future__ import annotations

import json

import pytest

from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.ledger import BudgetExhausted, PrivacyLedger
from dpfy.train.step_record import StepRecord

STEP = StepRecord(SamplingRecord(SamplingKind.POISSON, 0.01, 10_000), 1.1)

#: A version-1 checkpoint as the ledger wrote it before the split, key order included.
SAVED = (
    '{"format": "dpfy.privacy-ledger", "version": 1, "accountant": "pld", '
    '"relation": "add-or-remove", "delta": 1e-05, "target_epsilon": 4.0, "entries": '
    '[{"label": "training", "count": 3, "sampling": {"kind": "poisson", "sampling_rate": 0.01, '
    '"dataset_size": 10000, "batch_size": null}, "noise_multiplier": 1.1}, {"label": "tuning", '
    '"count": 2, "event": {"type": "PureDpEvent", "epsilon": 0.25}}], "examples_seen": 291, '
    '"sized_steps": 3, "run_id": "abc123"}'
)


def test_a_saved_checkpoint_loads_and_saves_back_to_the_same_text():
    ledger = PrivacyLedger.from_state_dict(json.loads(SAVED))
    assert json.dumps(ledger.state_dict()) == SAVED
    assert (ledger.steps, ledger.run_id, ledger.target_epsilon) == (3, "abc123", 4.0)
    assert ledger.summary().examples_seen == 291
    assert ledger.summary().labelled_events == {"tuning": 2}
    resumed = PrivacyLedger(1e-5, accountant="pld")
    resumed.load_state_dict(json.loads(SAVED))
    assert resumed.target_epsilon is None  # the target is the resuming ledger's own
    assert resumed.epsilon_by_label() == ledger.epsilon_by_label()


def test_lowering_the_target_drops_the_room_counted_against_the_old_one():
    ledger = PrivacyLedger(1e-5, accountant="pld", target_epsilon=2.0)
    assert ledger.remaining_steps(STEP) > 100  # counted, and cached, against ε = 2
    ledger.check_step(STEP)
    ledger.record(STEP)
    ledger.target_epsilon = 0.9 * ledger.epsilon()
    with pytest.raises(BudgetExhausted):
        ledger.check_step(STEP)
    assert ledger.remaining_steps(STEP) == 0
    with pytest.raises(ValueError, match="target_epsilon"):
        ledger.target_epsilon = -1.0
    ledger.target_epsilon = None
    ledger.check_step(STEP)  # no target: every step fits
