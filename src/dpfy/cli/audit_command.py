"""``dpfy audit RUN_DIR``: measure the privacy a run's step actually has, beside the ε it claims.

The command parses options, states the cost, shows a progress bar and prints ε̂ beside the
claim, what each audit exercised and what it did not, and the run's behaviour checks from
training (every gap named); the job (:mod:`dpfy.jobs.audit`, imported when the command runs,
so ``dpfy --help`` stays quick) re-runs the step and writes the audit into the run directory.
Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["audit"]

_USAGE_ERROR = 2
_METHOD_HELP = (
    "classical (runs with all canaries in and all out; ε̂ of one step, one DP-FTRL epoch, or "
    "the whole run of BandMF / BLT), "
    "one-run (each canary in with probability ½, one run; Steinke et al. 2023), both, or "
    "black-box (re-trains the run once with input-space canaries and attacks its final model)."
)


def audit(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `dpfy train`.")],
    method: Annotated[str, typer.Option(help=_METHOD_HELP)] = "classical",
    canaries: Annotated[
        int, typer.Option(help="Canaries: Dirac gradients per session, or black-box records.")
    ] = 100,
    blocks: Annotated[
        int | None,
        typer.Option(
            help="Trials per session: steps (DP-SGD), epochs (DP-FTRL), or whole re-runs a "
            "side (BandMF, BLT). Default 200, or 10 whole re-runs."
        ),
    ] = None,
    confidence: Annotated[float, typer.Option(help="Confidence of the lower bound ε̂.")] = 0.95,
    seed: Annotated[int | None, typer.Option(help="Seed the audit (reproducible).")] = None,
) -> None:
    """Audit a run (its private step, or a re-run's final model): ε̂ beside the claimed ε."""
    from rich.console import Console
    from rich.progress import Progress

    from dpfy.audit.scope import behaviour_lines, scope_of
    from dpfy.jobs.audit import (
        DEFAULT_BLOCKS,
        AuditConfig,
        default_blocks,
        load_run,
        plan_cost,
        record_audits,
        run_audit,
    )

    console = Console()
    try:
        given = DEFAULT_BLOCKS if blocks is None else blocks
        config = AuditConfig(method, canaries, given, confidence=confidence, seed=seed)
        facts = load_run(run_dir)
        if blocks is None:
            config = dataclasses.replace(config, blocks=default_blocks(facts))
        cost = plan_cost(facts, config, run_dir)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(_USAGE_ERROR) from None
    for line in cost.lines():
        console.print(line)
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("auditing", total=cost.steps)
            outcomes = run_audit(cost, config, lambda: progress.advance(task))
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(_USAGE_ERROR) from None
    written = record_audits(run_dir, facts, outcomes)
    for result in (outcome.result for outcome in outcomes):
        claim = "unknown" if result.claimed_epsilon is None else f"{result.claimed_epsilon:.3g}"
        verdict = (
            "ABOVE the claim: a privacy bug"
            if result.exceeds_claim
            else "≤ the claim, for what was audited"
        )
        scope = scope_of(result.audited_scope)
        console.print(
            f"{result.method}: ε̂ = {result.epsilon_lower_bound:.3g} at {result.confidence:g} "
            f"confidence, claimed ε = {claim} ({verdict}); {result.canaries} canaries, "
            f"{result.runs} run(s), {result.seconds:.1f} s"
        )
        console.print(f"  audited: {scope.audited}", highlight=False)
        console.print(f"  not audited: {scope.not_audited}", highlight=False)
    console.print("the run's behaviour checks from training (its own collate, model, loss, state):")
    for line in behaviour_lines(cost.behaviour_checks):
        console.print(f"  {line}", highlight=False)
    console.print(
        f"audit: {written} · plots: {run_dir / 'audit'} · report: {run_dir / 'report.md'}"
    )
