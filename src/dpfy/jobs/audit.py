"""``dpfy audit RUN_DIR``: re-run a finished run's private step with canaries, ε̂ into its report.

The run's facts (``facts.json``, written by ``dpfy train``) hold its plan: N, B (so q), σ, C, δ,
the sampler, the algorithm, the clipping unit and the noise mechanism. The audit rebuilds that
private step with :func:`dpfy.train.builder.make_private` on white-box canary records
(:mod:`dpfy.audit.whitebox`) — its own small canary model, never the trained one, so the run's
model and its utility are untouched — and appends each :class:`~dpfy.audit.result.AuditResult`
to the facts, re-rendering ``report.md`` and ``report.json`` and writing ``audit.json``, with
the plots of each audit's scores in and out (histograms and ROC) under ``RUN_DIR/audit/``.
The white-box sessions spend no privacy of the run's data: they see only canaries and blanks.
A BandMF or BLT run (matrix-factorisation noise, correlated over the whole run) is re-run whole
in every session (:mod:`dpfy.audit.correlated`): ``--blocks`` counts those re-runs a side, and
ε̂ is of the whole run.
``--method black-box`` instead re-trains the run once with input-space canaries
(:mod:`dpfy.jobs.blackbox_audit`) and attacks only that model's final state.

Neither audits the run's own model, loss or data pipeline as they ran, so every result names
its scope (:mod:`dpfy.audit.scope`) and carries the run's behaviour checks from training, read
from the top-level ``behaviour_checks`` of ``facts.json`` as a plain dict (absent: "not
recorded"); the audit keeps that key in the facts it rewrites.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpfy._safe_io import read_json
from dpfy._validate import check_seed
from dpfy.audit.correlated import seconds_per_step as factorised_seconds_per_step
from dpfy.audit.fdp import check_fdp_applies
from dpfy.audit.fdp import seconds_per_step as fdp_seconds_per_step
from dpfy.audit.observe import StepSettings, run_session
from dpfy.audit.plots import write_audit_plots
from dpfy.audit.result import AuditResult
from dpfy.audit.scope import BehaviourChecks, check_behaviour_checks
from dpfy.audit.whitebox import (
    audit_private_step,
    audit_steps,
    check_independent_trials,
    chosen_method,
    design_for,
)
from dpfy.jobs.blackbox_audit import BlackBoxRun, plan_blackbox, run_blackbox
from dpfy.jobs.run_lock import AUDIT_LOCK, AuditLock, audit_in_progress
from dpfy.plan.correlated_events import describe_strategy
from dpfy.report.card import build_report
from dpfy.report.facts import RunFacts, recompute_accounting
from dpfy.report.render import FACTS_FILE, write_report

#: The audit's own file in the run directory: every audit recorded so far.
AUDIT_FILE = "audit.json"
#: Where the plots of each audit's scores go, inside the run directory.
PLOTS_DIR = "audit"
#: What ``--method`` may name.
AUDIT_METHODS = ("auto", "f-dp", "classical", "one-run", "one-run-f-dp", "both", "black-box")
#: The top-level key of facts.json where training records its behaviour checks.
CHECKS_KEY = "behaviour_checks"
#: ``--blocks`` when not given: trials of one step or epoch, or whole re-runs (BandMF, BLT).
DEFAULT_BLOCKS = 200
#: Upper bounds on ``--blocks`` and ``--canaries``: an audit keeps each trial's scores, and
#: 10¹² blocks would ask numpy for petabytes.
MAX_BLOCKS = 100_000
MAX_CANARIES = 100_000
DEFAULT_FACTORISED_BLOCKS = 10
#: ``--canaries`` when not given; the f-DP step audit's canaries in (and out) per step, steps.
DEFAULT_CANARIES = 100
DEFAULT_FDP_CANARIES = 10_000
DEFAULT_FDP_STEPS = 100
#: ``--confidence`` when not given: 0.95, or 0.99 for the f-DP audit (see :func:`resolved`).
DEFAULT_CONFIDENCE = 0.95
DEFAULT_FDP_CONFIDENCE = 0.99


@dataclass(frozen=True)
class AuditConfig:
    """What ``dpfy audit`` was asked: method, canaries, trials (blocks), confidence, seed."""

    method: str = "auto"
    canaries: int = DEFAULT_CANARIES
    blocks: int = DEFAULT_BLOCKS
    probes: int = 64
    confidence: float = 0.95
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.method not in AUDIT_METHODS:
            raise ValueError(f"--method must be one of {', '.join(AUDIT_METHODS)}")
        for name in ("canaries", "blocks", "probes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"--{name} must be a whole number, got {value!r}")
        if self.canaries < 1 or self.blocks < 5:
            raise ValueError("--canaries must be ≥ 1 and --blocks ≥ 5 (a fifth picks a threshold)")
        for name, most in (("canaries", MAX_CANARIES), ("blocks", MAX_BLOCKS)):
            if getattr(self, name) > most:
                raise ValueError(
                    f"--{name} must be at most {most:,}, got {getattr(self, name):,}: the audit "
                    f"holds every trial's scores in memory, and {most:,} already bounds ε̂ far "
                    "tighter than the confidence allows; lower it"
                )
        check_seed(self.seed, "--seed")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"--confidence must lie in (0, 1), got {self.confidence}")

    @property
    def methods(self) -> tuple[str, ...]:
        """The audits to run, in order."""
        return ("classical", "one-run") if self.method == "both" else (self.method,)


@dataclass(frozen=True)
class AuditCost:
    """What the audit will cost, stated before it starts (``blackbox``: the re-training run).

    ``behaviour_checks`` are the run's checks from training (None: not recorded), which every
    result of the audit carries beside its scope.
    """

    settings: StepSettings | None
    canaries: int
    steps: int
    seconds: float
    blackbox: BlackBoxRun | None = None
    behaviour_checks: BehaviourChecks | None = None

    def lines(self) -> list[str]:
        """The cost as sentences for the terminal."""
        if self.blackbox is not None:
            return self.blackbox.lines()
        s = self.settings
        assert s is not None  # a white-box audit always has its step's settings
        lines = [
            f"re-runs the run's private step ({s.algorithm} per {s.unit}, N = {s.records}, "
            f"B = {s.batch_size}, σ = {s.noise_multiplier:.4g}, C = {s.max_grad_norm:g}) on "
            f"{self.canaries} canaries: {self.steps} steps, about {self.seconds:.0f} s",
        ]
        if s.factorised:
            lines.append(
                f"its matrix-factorisation noise ({describe_strategy(s.mechanism, s.strategy)}) "
                f"is correlated over the whole run, so each session re-runs all "
                f"{s.steps_per_block} steps (one trial per canary) and ε̂ is of the whole run; "
                "the statistic decorrelates the released updates with C and sums them over each "
                "canary's steps"
            )
        lines.append(
            "the canaries go into a separate canary model, not the trained one: the run's "
            "model, accuracy and privacy ledger are unchanged"
        )
        return lines


def _refuse_while_training(run_dir: Path) -> None:
    """An audit writes into the run's report: refused while the run trains or resumes."""
    from dpfy.jobs.checkpoint import RUNNING, read_status, running_elsewhere

    status = read_status(run_dir) or {}
    if status.get("status") == RUNNING and running_elsewhere(status):
        raise ValueError(
            f"{run_dir} is being trained by process {status.get('pid')} on "
            f"{status.get('host')}; audit it once that run has stopped (its report would "
            "replace the audit's)"
        )


def lock_for_audit(run_dir: Path, on_wait: Callable[[str], None] | None = None) -> AuditLock:
    """Take the run directory's audit lock, waiting for an audit already under way.

    Refused, with one line, where the directory cannot be written (an audit writes its results
    there) or the run is training or resuming.
    """
    import fcntl

    from dpfy._safe_io import write_failed

    if not Path(run_dir).is_dir():
        raise ValueError(f"{run_dir} is not a directory; pass a run directory of `dpfy train`")
    _refuse_while_training(run_dir)
    path = run_dir / AUDIT_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as err:
        raise ValueError(
            f"cannot write to {run_dir} ({err.strerror or err}); an audit records its results "
            "in the run directory: make it writable, or audit a writable copy"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(f"another audit of {run_dir} is under way; waiting for it to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        _refuse_while_training(run_dir)  # a resume may have started while we waited
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    except ValueError:
        os.close(fd)
        raise
    except OSError as err:
        os.close(fd)
        raise write_failed(path, err) from None
    return AuditLock(run_dir, fd)


def default_blocks(facts: RunFacts) -> int:
    """``--blocks`` when not given: 200 trials of a step (or epoch), or 10 whole re-runs a side
    of a matrix-factorisation run (each as long as the run)."""
    if facts.privacy.strategy is not None:
        return DEFAULT_FACTORISED_BLOCKS
    return DEFAULT_BLOCKS


def default_method(facts: RunFacts) -> str:
    """``--method auto``: the f-DP step audit where it applies (Poisson DP-SGD under
    add-or-remove: ε̂ near ε in seconds), else the classical audit."""
    try:
        check_fdp_applies(StepSettings.from_plan(facts.privacy))
    except ValueError:
        return "classical"
    return "f-dp"


def resolved(
    config: AuditConfig,
    facts: RunFacts,
    *,
    canaries_given: bool,
    blocks_given: bool,
    confidence_given: bool = True,
) -> AuditConfig:
    """``config`` with "auto" and the options not given filled in for this run.

    The f-DP audit's ε̂ sits close to a correct claim, so a correct run would cross it up to
    1 − confidence of the time: its default confidence is the stricter
    :data:`DEFAULT_FDP_CONFIDENCE`, which costs it almost nothing with 10⁶ trials a side.
    """
    method = default_method(facts) if config.method == "auto" else config.method
    fdp = method == "f-dp"
    canaries = DEFAULT_FDP_CANARIES if fdp else DEFAULT_CANARIES
    blocks = DEFAULT_FDP_STEPS if fdp else default_blocks(facts)
    confidence = DEFAULT_FDP_CONFIDENCE if fdp else DEFAULT_CONFIDENCE
    return dataclasses.replace(
        config,
        method=method,
        canaries=config.canaries if canaries_given else canaries,
        blocks=config.blocks if blocks_given else blocks,
        confidence=config.confidence if confidence_given else confidence,
    )


def load_run(run_dir: Path) -> RunFacts:
    """The run's facts (ε recomputed from its ledger), or one error naming the fix."""
    if not (run_dir / FACTS_FILE).is_file():
        if (run_dir / "report.json").is_file():  # label-, input- or prediction-level
            raise ValueError(
                f"{run_dir} is a run without a private training step (--access label, input "
                "or prediction), so there is nothing to audit; audit a full-training run "
                "(--access full, the default)"
            )
        raise ValueError(f"{run_dir} holds no {FACTS_FILE}; pass a run directory of `dpfy train`")
    path = run_dir / FACTS_FILE
    read_json(path, "facts")  # bounded and regular-file only: a FIFO or device is one line
    data = _facts_json(path)
    if CHECKS_KEY not in data or CHECKS_KEY in {f.name for f in dataclasses.fields(RunFacts)}:
        return RunFacts.load(path)
    # the checks are read on their own (behaviour_checks); the typed facts do not hold them
    try:
        return recompute_accounting(
            RunFacts.from_dict({k: v for k, v in data.items() if k != CHECKS_KEY})
        )
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def behaviour_checks(run_dir: Path) -> BehaviourChecks | None:
    """The run's behaviour checks from training, as its facts.json holds them; None if absent.

    A malformed record is one ValueError naming the file and the field.
    """
    path = run_dir / FACTS_FILE
    data = _facts_json(path)
    if data.get(CHECKS_KEY) is None:
        return None
    try:
        return check_behaviour_checks(data[CHECKS_KEY], CHECKS_KEY)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _facts_json(path: Path) -> dict:
    """facts.json as plain JSON; {} when unreadable (RunFacts.load words that error)."""
    try:
        data = read_json(path, "facts")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def plan_cost(facts: RunFacts, config: AuditConfig, run_dir: Path | None = None) -> AuditCost:
    """The audited step's settings, the canaries that fit, and a timed estimate of the cost.

    The black-box audit re-trains the run, so it needs ``run_dir`` (its ``config.json``);
    the run's behaviour checks are read from ``run_dir`` too (without it: not recorded).
    """
    checks = None if run_dir is None else behaviour_checks(run_dir)
    if config.method == "black-box":
        if run_dir is None:
            raise ValueError("the black-box audit re-trains the run: pass its run directory")
        run = plan_blackbox(run_dir, facts, config.canaries, config.seed)
        return AuditCost(None, run.canaries, run.steps, run.seconds, run, checks)
    settings = StepSettings.from_plan(facts.privacy)
    if "classical" in config.methods:
        check_independent_trials(settings)
    fdp_only = tuple(chosen_method(settings, m) for m in config.methods) == ("f-dp",)
    canaries = config.canaries if fdp_only else fitted_canaries(settings, config.canaries)
    steps = sum(audit_steps(settings, m, config.blocks) for m in config.methods)
    per_step = fdp_seconds_per_step(settings, canaries) if fdp_only else None
    seconds = steps * (per_step or _seconds_per_step(settings, canaries))
    return AuditCost(settings, canaries, steps, seconds, behaviour_checks=checks)


def fitted_canaries(settings: StepSettings, wanted: int) -> int:
    """At most ``wanted``; with removal, at most N − B (the out side must still fill a batch).

    A matrix-factorisation audit never removes a canary (:func:`dpfy.audit.correlated.out_side`),
    so all N records may be canaries.
    """
    if settings.relation != "add-or-remove" or settings.factorised:
        return min(wanted, settings.records)
    room = settings.records - settings.batch_size
    if room < 1:
        raise ValueError(
            f"the run samples every record each step (B = N = {settings.records}), so removing "
            "a canary leaves no full batch: audit a run with B < N"
        )
    return min(wanted, room)


def _seconds_per_step(settings: StepSettings, canaries: int) -> float:
    """Time a few steps of the audit session, after one to warm up (the estimate shown)."""
    if settings.factorised:
        return factorised_seconds_per_step(settings, canaries)
    design = design_for(settings, canaries, 2)
    blocks = max(1, math.ceil(4 / settings.steps_per_block))
    run_session(settings, design, torch.ones(canaries, dtype=torch.bool), 1, 0)
    start = time.perf_counter()
    run_session(settings, design, torch.ones(canaries, dtype=torch.bool), blocks, 0)
    return (time.perf_counter() - start) / (blocks * settings.steps_per_block)


@dataclass(frozen=True)
class AuditOutcome:
    """One audit's result and the scores it came from (higher: "in"), for the plots."""

    result: AuditResult
    scores_in: np.ndarray
    scores_out: np.ndarray


def run_audit(
    cost: AuditCost, config: AuditConfig, on_step: Callable[[], None] | None = None
) -> tuple[AuditOutcome, ...]:
    """Every audit ``config`` asks for, on the step (or re-run) ``cost`` describes.

    Each result carries the run's behaviour checks (``cost.behaviour_checks``).
    """
    if cost.blackbox is not None:
        result, *scores = run_blackbox(cost.blackbox, config.confidence, on_step)
        checked = result.with_context(behaviour_checks=cost.behaviour_checks)
        return (AuditOutcome(checked, *scores),)
    assert cost.settings is not None
    outcomes = []
    for method in config.methods:
        seen: list[np.ndarray] = []
        result = audit_private_step(
            cost.settings,
            method=method,
            canaries=cost.canaries,
            blocks=config.blocks,
            probes=config.probes,
            confidence=config.confidence,
            seed=config.seed,
            on_step=on_step,
            on_scores=lambda scores_in, scores_out, seen=seen: seen.extend((scores_in, scores_out)),
        )
        checked = result.with_context(behaviour_checks=cost.behaviour_checks)
        outcomes.append(AuditOutcome(checked, *seen))
    return tuple(outcomes)


def record_audits(run_dir: Path, facts: RunFacts, outcomes: tuple[AuditOutcome, ...]) -> Path:
    """Append the audits to the run's facts, re-render its report, plot them, write audit.json.

    Each audit's plots are numbered by its place among the run's audits, so a second audit
    adds its own files beside the first's; audit.json names every audit's plots. Its rows are
    the card's: each audit's figures, scope (what was audited, what was not) and verdict, and
    the run's behaviour checks beside them. A ``behaviour_checks`` record in facts.json that
    the typed facts do not hold is kept there.
    """
    from dpfy._safe_io import atomic_write_text
    from dpfy.jobs.outcome import add_interrupted_banner

    results = tuple(outcome.result for outcome in outcomes)
    facts = load_run(run_dir)  # under the audit lock: with what other audits recorded meanwhile
    updated = dataclasses.replace(facts, audits=(*facts.audits, *results))
    kept = _facts_json(run_dir / FACTS_FILE).get(CHECKS_KEY)
    write_report(updated, run_dir, plots=False)
    if kept is not None:
        _keep_checks(run_dir / FACTS_FILE, kept)
    add_interrupted_banner(run_dir)  # a report of part of a run stays marked as such
    target = run_dir / AUDIT_FILE
    plots = _previous_plots(target)
    for index, outcome in enumerate(outcomes, start=len(facts.audits) + 1):
        name = f"{index}-{outcome.result.method}"
        paths = write_audit_plots(  # titles carry ε̂ and the claim this audit tested
            outcome.scores_in, outcome.scores_out, run_dir / PLOTS_DIR, name, result=outcome.result
        )
        plots[str(index - 1)] = {kind: str(p.relative_to(run_dir)) for kind, p in paths.items()}
    section = build_report(updated).to_json()["empirical_audit"]
    document = {
        "audits": section["audits"],
        "plots": plots,
        **{key: section[key] for key in ("behaviour_checks", "behaviour_check_gaps")},
        "behaviour_statement": section["behaviour_statement"],
    }
    atomic_write_text(target, json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    return target


def _keep_checks(path: Path, checks: object) -> None:
    """Put the run's behaviour checks back into the facts just written, if they dropped them."""
    from dpfy._safe_io import atomic_write_text

    data = json.loads(path.read_text(encoding="utf-8"))
    if CHECKS_KEY not in data:
        data[CHECKS_KEY] = checks
        atomic_write_text(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def _previous_plots(audit_file: Path) -> dict[str, dict[str, str]]:
    """The plots an earlier audit.json names (by audit index), or none if it names none."""
    try:
        plots = json.loads(audit_file.read_text()).get("plots", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return plots if isinstance(plots, dict) else {}


__all__ = [
    "AUDIT_FILE",
    "AUDIT_LOCK",
    "AUDIT_METHODS",
    "CHECKS_KEY",
    "DEFAULT_BLOCKS",
    "DEFAULT_FACTORISED_BLOCKS",
    "PLOTS_DIR",
    "AuditConfig",
    "AuditCost",
    "AuditLock",
    "AuditOutcome",
    "audit_in_progress",
    "behaviour_checks",
    "default_blocks",
    "default_method",
    "fitted_canaries",
    "load_run",
    "lock_for_audit",
    "plan_cost",
    "record_audits",
    "resolved",
    "run_audit",
]
