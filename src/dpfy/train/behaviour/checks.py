"""One run's behaviour checks: the probes, what they found, and the refusal at the step.

The probes of the collate path, the model and the loss each report a coupling against the
batch it was seen on; the private step asks :meth:`BehaviourChecks.refuse` before anything
changes, so a coupled batch is never applied. The probes follow examples, never the padding
rows of a static-shape batch (``current``: the loader's batch in hand, which marks them). The
state watch refuses a model changed outside the step. :meth:`BehaviourChecks.summary` is what
the report card says of each check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.collate_probe import COUPLED, PASSED
from dpfy.data.coupling import CheckTally, ExamplesCoupled
from dpfy.data.provenance import DrawnBatch
from dpfy.train.behaviour.example_rows import ExampleRows, all_rows
from dpfy.train.behaviour.loss_probe import CheckedCriterion
from dpfy.train.behaviour.model_probe import ModelProbe
from dpfy.train.behaviour.state_watch import StateChanged, StateWatch
from dpfy.train.grads.engine import GradEngine

_NO_CRITERION = (
    "no criterion= was given to make_private, so the loss was not checked; pass it and call "
    "private.criterion(output, target) to check that the loss treats examples independently"
)


class BehaviourChecks:
    """The collate, model and loss probes and the state watch of one private run."""

    def __init__(
        self,
        engine: GradEngine,
        schedule: CheckSchedule,
        batch_number: Callable[[], int | None],
        *,
        loss_reduction: str,
        criterion: Callable[..., torch.Tensor] | None = None,
        public_buffers: Iterable[str] = (),
        current: Callable[[], DrawnBatch | None] | None = None,
        chunk: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        self.schedule = schedule
        # the probes follow examples only: which rows of a pass are padding, from its batch
        examples = all_rows if current is None else ExampleRows(current, chunk or _whole)
        self._found: dict[int, str] = {}  # batch number → the first coupling seen on it
        self._tallied: int | None = None  # the batch whose collate probe was counted
        self._state_problem: str | None = None
        self.collate = CheckTally("collate")
        if schedule.off:
            self.collate.skip("the independence checks were turned off")
        self.model = ModelProbe(engine, schedule, batch_number, self._report, examples)
        self.loss: CheckedCriterion | None = None
        if criterion is not None:
            self.loss = CheckedCriterion(
                criterion, schedule, batch_number, self._report, loss_reduction, examples
            )
        self.state = StateWatch(engine.model, public_buffers)
        self.state.record()

    def _report(self, batch: int, problem: str) -> None:
        """A probe saw ``problem`` on batch number ``batch``."""
        self._found.setdefault(batch, problem)

    def refuse(self, batch: DrawnBatch, *, closing: bool) -> None:
        """Raise if ``batch`` coupled its examples or (when ``closing``) the state changed.

        The state first: a forward pass that writes into the model also changes what a probe
        re-running it sees, and the write is the precise diagnosis.
        """
        self._tally_collate(batch)
        if closing:
            self._check_state()
            self._note_loss_unseen(batch)
        problem = self._found.pop(batch.number, None)
        if problem is None and batch.collate_probe is not None:
            status, detail = batch.collate_probe
            problem = detail if status == COUPLED else None
        if problem is not None:
            raise ExamplesCoupled(
                f"examples are coupled — {problem}. The step was refused before anything "
                "changed: each example's contribution must depend on that example alone"
            )

    def _note_loss_unseen(self, batch: DrawnBatch) -> None:
        """A scheduled batch whose loss did not go through private.criterion: stated."""
        loss = self.loss
        if loss is not None and self.schedule.due(batch.number) and loss.last_batch != batch.number:
            loss.tally.skip(
                "private.criterion was not called on a probed batch: the loop computed its "
                "loss another way, which was not checked"
            )

    def _check_state(self) -> None:
        """The state watch's check, its refusal kept for the card."""
        try:
            self.state.check()
        except StateChanged as err:
            self._state_problem = str(err)
            raise

    def _tally_collate(self, batch: DrawnBatch) -> None:
        """Count the batch's collate probe once (virtual batching asks once per chunk)."""
        if batch.collate_probe is None or self._tallied == batch.number:
            return
        self._tallied = batch.number
        status, detail = batch.collate_probe
        if status == PASSED:
            self.collate.passed()
        elif status == COUPLED:
            self.collate.found(detail, "the collate_fn")
        else:
            self.collate.skip(detail)

    def accept_state(self) -> None:
        """The model's state is one the run accounts for: after a private update or a load."""
        self.state.record()

    def _state_summary(self) -> dict[str, Any]:
        """The state watch's record: every step checked, or the write it refused."""
        checks = self.state.checks
        if self._state_problem is not None:
            detail = "a parameter or buffer changed outside the private step"
            return {"status": "refused", "probes": checks, "detail": detail}
        if checks == 0:
            return {"status": "not run", "probes": 0, "detail": "no step was taken"}
        return {"status": "passed", "probes": checks, "detail": ""}

    def detach(self) -> None:
        """Remove the model probe's hooks."""
        self.model.remove()

    def summary(self) -> dict[str, dict[str, Any]]:
        """What each check did over the run, for the report card."""
        loss = self.loss.tally if self.loss is not None else _not_given()
        summary = {
            "collate": self.collate.summary(),
            "model": self.model.tally.summary(),
            "loss": loss.summary(),
            "state": self._state_summary(),
        }
        for entry in summary.values():
            entry.setdefault("schedule", str(self.schedule))
        summary["state"]["schedule"] = "every step"
        if self.state.public:
            summary["state"]["detail"] = "public buffers: " + ", ".join(sorted(self.state.public))
        return summary


def _whole() -> tuple[int, int] | None:
    """Without virtual batching a forward pass holds the whole batch."""
    return None


def _not_given() -> CheckTally:
    """The loss check's tally when no criterion was given."""
    tally = CheckTally("loss")
    tally.skip(_NO_CRITERION)
    return tally
