"""``dpfy audit RUN_DIR``: measure the privacy a run's step actually has, beside the ε it claims.

The command parses options, states the cost, shows a progress bar and prints ε̂ beside the
claim, what each audit exercised and what it did not, and the run's behaviour checks from
training (every gap named); the job (:mod:`dpfy.jobs.audit`, imported when the command runs,
so ``dpfy --help`` stays quick) re-runs the step and writes the audit into the run directory.
Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import click
import typer

__all__ = ["audit"]

_USAGE_ERROR = 2
_METHOD_HELP = (
    "auto (the default: f-dp where it applies, else classical), "
    "f-dp (one Poisson DP-SGD step: 10⁴ canaries in and out per step, the claimed Gaussian "
    "tradeoff fitted; ε̂ near ε in seconds), "
    "classical (runs with all canaries in and all out; ε̂ of one step, one DP-FTRL epoch, or "
    "the whole run of BandMF / BLT), "
    "one-run (each canary in with probability ½, one run; Steinke et al. 2023), one-run-f-dp "
    "(the same run tested against the claimed tradeoff curve; Mahloujifar et al. 2024), both, or "
    "black-box (re-trains the run once with input-space canaries and attacks its final model)."
)


def _checked_method(value: str) -> str:
    """``--method`` is one of the audits the job offers, refused by name before anything runs."""
    from dpfy.jobs.audit import AUDIT_METHODS

    if value not in AUDIT_METHODS:
        raise click.BadParameter(
            f"{value!r} is not one of {', '.join(AUDIT_METHODS)}", param_hint="'--method'"
        )
    return value


def _claim(result: Any, run_epsilon: float | None) -> str:
    """The claim ε̂ is held against: the ε of what the audit itself tests (a step, an epoch, a
    re-run), which is not the run's whole ε; both are named so neither is mistaken for the other."""
    if result.claimed_epsilon is None:
        return "claimed ε unknown"
    whole = "" if run_epsilon is None else f"; the whole run claims ε = {run_epsilon:.3g}"
    return f"claimed ε = {result.claimed_epsilon:.3g} for the part this audit tests{whole}"


def _document(outcomes: Any, written: Path, run_dir: Path, run_epsilon: float | None) -> str:
    """``--json``: every audit's figures, the run's own ε, and where the audit is written."""
    audits = [
        {
            "method": r.method,
            "epsilon_lower_bound": r.epsilon_lower_bound,
            "confidence": r.confidence,
            "audit_claimed_epsilon": r.claimed_epsilon,
            "exceeds_claim": r.exceeds_claim,
            "canaries": r.canaries,
            "runs": r.runs,
            "seconds": r.seconds,
            "scope": r.audited_scope,
        }
        for r in (outcome.result for outcome in outcomes)
    ]
    finite = run_epsilon if run_epsilon is None or math.isfinite(run_epsilon) else None
    return json.dumps(
        {
            "status": "finished",
            "run_dir": str(run_dir),
            "run_epsilon": finite,
            "audits": audits,
            "paths": {
                "audit": str(written),
                "plots": str(run_dir / "audit"),
                "report": str(run_dir / "report.md"),
            },
        }
    )


def audit(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `dpfy train`.")],
    method: Annotated[str, typer.Option(help=_METHOD_HELP, callback=_checked_method)] = "auto",
    canaries: Annotated[
        int | None,
        typer.Option(
            help="Canaries: Dirac gradients per session (f-dp: in, and as many out, per step), "
            "or black-box records. Default 10⁴ for f-dp, else 100."
        ),
    ] = None,
    blocks: Annotated[
        int | None,
        typer.Option(
            help="Trials per session: steps (DP-SGD), epochs (DP-FTRL), or whole re-runs a "
            "side (BandMF, BLT). Default 100 steps for f-dp, 200, or 10 whole re-runs."
        ),
    ] = None,
    confidence: Annotated[
        float | None,
        typer.Option(help="Confidence of the lower bound ε̂. Default 0.99 for f-dp, else 0.95."),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed the audit (reproducible).")] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", help="Print only the path of the audit's audit.json.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
) -> None:
    """Audit a run (its private step, or a re-run's final model): ε̂ beside the claimed ε."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from dpfy.audit.scope import behaviour_lines, scope_of
    from dpfy.jobs.audit import (
        DEFAULT_BLOCKS,
        DEFAULT_CANARIES,
        DEFAULT_CONFIDENCE,
        AuditConfig,
        load_run,
        lock_for_audit,
        plan_cost,
        record_audits,
        resolved,
        run_audit,
    )

    console = Console(soft_wrap=True, quiet=quiet or as_json)
    if quiet and as_json:
        typer.echo("error: pass --quiet or --json, not both", err=True)
        raise typer.Exit(_USAGE_ERROR)
    try:
        wanted = DEFAULT_CANARIES if canaries is None else canaries
        given = DEFAULT_BLOCKS if blocks is None else blocks
        sure = DEFAULT_CONFIDENCE if confidence is None else confidence
        config = AuditConfig(method, wanted, given, confidence=sure, seed=seed)
        lock = lock_for_audit(run_dir, on_wait=console.print)  # audits of one run take turns
        click.get_current_context().call_on_close(lock.release)
        facts = load_run(run_dir)
        config = resolved(
            config,
            facts,
            canaries_given=canaries is not None,
            blocks_given=blocks is not None,
            confidence_given=confidence is not None,
        )
        cost = plan_cost(facts, config, run_dir)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(_USAGE_ERROR) from None
    for line in cost.lines():
        console.print(line)
    try:
        columns = (
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        )  # fmt: skip
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("auditing", total=cost.steps)
            outcomes = run_audit(cost, config, lambda: progress.advance(task))
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(_USAGE_ERROR) from None
    written = record_audits(run_dir, facts, outcomes)
    run_epsilon = facts.accounting.summary.epsilon.get("total")
    if as_json:
        typer.echo(_document(outcomes, written, run_dir, run_epsilon))
        return
    if quiet:
        typer.echo(str(written))
        return
    for result in (outcome.result for outcome in outcomes):
        verdict = (
            "ABOVE the claim: a privacy bug"
            if result.exceeds_claim
            else "≤ the claim, for what was audited"
        )
        scope = scope_of(result.audited_scope)
        console.print(
            f"{result.method}: ε̂ = {result.epsilon_lower_bound:.3g} at {result.confidence:g} "
            f"confidence, {_claim(result, run_epsilon)} ({verdict}); {result.canaries} "
            f"canaries, {result.seconds:.1f} s",
            highlight=False,
        )
        console.print(f"  audited: {scope.audited}", highlight=False)
        console.print(f"  not audited: {scope.not_audited}", highlight=False)
    console.print("the run's behaviour checks from training (its own collate, model, loss, state):")
    for line in behaviour_lines(cost.behaviour_checks):
        console.print(f"  {line}", highlight=False)
    console.print(
        f"audit: {written} · plots: {run_dir / 'audit'} · report: {run_dir / 'report.md'}"
    )
