"""How a training job ends, in its run directory: finished, or interrupted and resumable.

A finished run writes its model, history, facts, report and plots, deletes its checkpoint (it
holds the random state the batches were drawn from) and marks its status finished. An interrupted
run writes a checkpoint at the step where it stopped and a report of what was spent so far, marked
interrupted and naming the command that continues it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dpfy._safe_io import atomic_write, atomic_write_text
from dpfy.data.datasets import LoadedDataset
from dpfy.data.users import UserSplit
from dpfy.jobs.checkpoint import (
    FINISHED,
    INTERRUPTED,
    RUNNING,
    JobState,
    checkpoint_consumed,
    mark_failed,
    read_status,
    remove_checkpoint,
    save_checkpoint,
    write_status,
)
from dpfy.jobs.config import CONFIG_FILE, TrainConfig, write_config
from dpfy.jobs.loop import TrainingStopped, accuracy
from dpfy.report.clip_norms import NormLog
from dpfy.train.session import PrivateTraining

if TYPE_CHECKING:
    from dpfy.report.facts import RunFacts
    from dpfy.report.pitfalls import Finding

#: The exit code of a run stopped by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED_EXIT = 130
#: Why a continuation stopped before its first checkpoint of its own cannot be resumed.
NOT_RESUMABLE = (
    "cannot be resumed: this continuation stopped before writing a checkpoint of its own, and "
    "the checkpoint it continued from was already resumed once (resuming it again would release "
    "the same steps twice); start a new run"
)


class Interrupted(Exception):
    """Ctrl-C stopped the run; its checkpoint and a report of what it spent are written."""

    def __init__(
        self, run_dir: Path, steps_taken: int, planned_steps: int, epsilon: float, delta: float,
        checkpointed: bool, resumable: bool = True,
    ) -> None:  # fmt: skip
        self.run_dir, self.steps_taken, self.planned_steps = run_dir, steps_taken, planned_steps
        self.epsilon, self.delta, self.checkpointed = epsilon, delta, checkpointed
        self.resumable = resumable
        where = f"step {steps_taken}" if checkpointed else "its last periodic checkpoint"
        then = (
            f"`dpfy train --resume {run_dir}` continues it from {where}"
            if resumable
            else f"it {NOT_RESUMABLE}"
        )
        super().__init__(
            f"interrupted after {steps_taken} of {planned_steps} steps (ε = {epsilon:.4g} spent "
            f"so far at δ = {delta:g}); {then}"
        )

    @property
    def report(self) -> Path:
        """The report of what was spent so far."""
        return self.run_dir / "report.md"


def interrupted_banner(run_dir: Path, steps: int, planned: int, resumable: bool) -> str:
    """The first line of an interrupted run's report: it covers only what was spent so far."""
    resume = f"`dpfy train --resume {run_dir}` continues the run"
    then = (
        f"{resume}, and its final report covers all steps."
        if resumable
        else f"The run {NOT_RESUMABLE}."
    )
    return (
        f"> **Interrupted** after {steps} of {planned} planned steps: this report covers only "
        f"what was spent so far. {then}\n\n"
    )


def add_interrupted_banner(run_dir: Path) -> None:
    """Put the interrupted banner on top of ``report.md`` when status.json says the run is
    interrupted (after the report was written or re-rendered, e.g. by an audit): a report of
    part of a run never reads as the final model's."""
    status = read_status(run_dir) or {}
    report = run_dir / "report.md"
    if status.get("status") != INTERRUPTED or not report.is_file():
        return
    text = report.read_text(encoding="utf-8")
    if text.startswith("> **Interrupted**"):
        return
    banner = interrupted_banner(
        run_dir, int(status.get("steps_taken", 0) or 0), int(status.get("planned_steps", 0) or 0),
        "resume" in status,
    )  # fmt: skip
    atomic_write_text(report, banner + text)


def failed(run_dir: Path, err: BaseException, private: PrivateTraining) -> None:
    """The run stopped on an error: status "failed" naming it; everything written is kept (the
    last periodic checkpoint included)."""
    mark_failed(run_dir, err, private.ledger.steps, private.plan.steps)


def started(run_dir: Path, config: TrainConfig, private: PrivateTraining) -> None:
    """Before the first step: the settings a resume replays, and the running status."""
    if not (run_dir / CONFIG_FILE).exists():
        write_config(config, run_dir)
    write_status(run_dir, RUNNING, private.ledger.steps, private.plan.steps)


def merged(prior: NormLog, current: NormLog) -> NormLog:
    """The gradient norms of the whole run: those carried over a resume, then this process's."""
    log = NormLog()
    for part in (prior.norms, current.norms):
        if part.size:
            log.add(part)
    return log


def _test_rows(config: TrainConfig, data: LoadedDataset) -> dict[str, str]:
    """Where the test accuracy was measured, said plainly when it is private rows of the user's
    own file: the guarantee does not cover them, and the split depends on every row's label."""
    if config.data is None or config.test_data is not None:
        return {}
    return {
        "evaluated_on": f"the {len(data.test)} test rows held out from {config.data} (private "
        "rows of the same file, split by their labels: their accuracy is outside the guarantee)"
    }


def _facts(
    private: PrivateTraining,
    config: TrainConfig,
    data: LoadedDataset,
    split: UserSplit | None,
    job: JobState,
    test_accuracy: float | None,
    baseline: float | None,
) -> RunFacts:
    """The report's facts about the run as it stands (all steps, across resumes)."""
    from dpfy.report.facts import ResultFacts, collect_facts

    return collect_facts(
        private,
        dataset_name=data.name,
        model_name=config.model,
        dataset_source=data.source if split is None else f"{data.source}; {split.describe()}",
        preprocessing=data.preprocessing,
        results=ResultFacts(
            accuracy=test_accuracy, baseline_accuracy=baseline, **_test_rows(config, data)
        ),
        grad_norms=job.norms.stats(config.max_grad_norm) if job.norms.norms.size else None,
        optimizer_name=config.optimizer,
        learning_rate=config.lr,
    )


def _earlier_audits(run_dir: Path) -> tuple[Any, ...]:
    """The audits an earlier report of this run recorded (an audit of it while interrupted):
    they audited the same private step, so the report of the resumed run keeps them."""
    from dpfy._safe_io import read_json
    from dpfy.audit.result import AuditResult

    try:
        document = read_json(run_dir / "facts.json", "facts")
        return tuple(AuditResult.from_dict(a) for a in document.get("audits") or ())
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return ()


def _write_report(run_dir: Path, facts: RunFacts, job: JobState) -> None:
    """history.json (train metrics labelled not private), facts, report card and plots."""
    import dataclasses

    from dpfy.report.history import write_history
    from dpfy.report.render import write_report

    earlier = _earlier_audits(run_dir)
    if earlier and not facts.audits:
        facts = dataclasses.replace(facts, audits=earlier)

    write_history(run_dir / "history.json", job.history)  # train metrics labelled not private
    write_report(facts, run_dir, history=job.history)


def finished(
    private: PrivateTraining,
    run_dir: Path,
    config: TrainConfig,
    data: LoadedDataset,
    split: UserSplit | None,
    job: JobState,
    test_accuracy: float,
    baseline: float | None,
) -> tuple[Finding, ...]:
    """Write the finished run; return the pitfalls its report card flags, errors first."""
    from dpfy.report.pitfalls import find_pitfalls

    atomic_write(run_dir / "model.pt", lambda path: torch.save(private.model.state_dict(), path))
    facts = _facts(private, config, data, split, job, test_accuracy, baseline)
    _write_report(run_dir, facts, job)
    remove_checkpoint(run_dir)
    write_status(run_dir, FINISHED, private.ledger.steps, private.plan.steps)
    return find_pitfalls(facts)


def interrupted(
    private: PrivateTraining,
    run_dir: Path,
    config: TrainConfig,
    data: LoadedDataset,
    split: UserSplit | None,
    job: JobState,
    stopped: TrainingStopped,
) -> Interrupted | KeyboardInterrupt:
    """Write the checkpoint (when the stop fell between steps) and the interrupted report.

    Under torchrun the ranks cannot agree on a step to save at, so there Ctrl-C stops as usual
    and a resume continues from the last periodic checkpoint.
    """
    if private.replicas.world_size > 1:
        return KeyboardInterrupt()
    if stopped.at_step_boundary:
        save_checkpoint(private, run_dir, job)
    resumable = not checkpoint_consumed(run_dir)  # a checkpoint of its own was not resumed yet
    steps, planned = private.ledger.steps, private.plan.steps
    # Stopped inside a step, the model in memory is past the last checkpoint, and a resume will
    # train those steps again (with fresh noise): nothing computed from that model is published,
    # so they are released once.
    shown = accuracy(private.model, data.test) if stopped.at_step_boundary else None
    facts = _facts(private, config, data, split, job, shown, None)
    _write_report(run_dir, facts, job)
    write_status(run_dir, INTERRUPTED, steps, planned, resumable=resumable)
    add_interrupted_banner(run_dir)
    return Interrupted(
        run_dir, steps, planned, private.epsilon(), private.plan.delta, stopped.at_step_boundary,
        resumable,
    )  # fmt: skip
