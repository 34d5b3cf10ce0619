"""What ``dpfy train`` prints when a run ends: a short summary, only the run directory
(``--quiet``), or one JSON object (``--json``), and the exit code its pitfalls call for.

Everything here is plain text written line by line, never a rich table: a table is cut or wrapped
to the terminal's width (80 columns when piped), which would break the paths a script reads.
The whole report card is in ``report.md``; the summary names it, and the diagnostics file beside
it (un-noised statistics of the private data, not for publication). The non-private baseline's
accuracy is printed here, on the user's own terminal, and kept in that file, never on the card.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from dpfy.jobs.outcome import Interrupted
    from dpfy.jobs.train import TrainResult
    from dpfy.report.pitfalls import Finding

#: ``dpfy train``'s exit code when the report card flags an ERROR pitfall: the run finished and
#: everything is written, but the stated guarantee is not established as reported.
PITFALL_EXIT = 3

_SHOWN = {"error": "ERROR", "warning": "WARN"}  # INFO findings stay in the report

#: Findings that qualify the guarantee without breaking it: a seeded run is an experiment (its
#: ε holds while the seed stays secret), so it is a WARN and exits 0 — unless ``--strict``.
GUARANTEE_WARNINGS = frozenset({"seeded-randomness"})


class Output(str, Enum):
    """How much ``dpfy train`` prints."""

    summary = "summary"
    quiet = "quiet"
    json = "json"


def _finite(value: float | None) -> float | None:
    """JSON has no infinity or NaN: an unbounded ε is null."""
    return value if value is None or math.isfinite(value) else None


def severity(finding: Finding) -> str:
    """The finding's severity as the CLI reports it (a guarantee warning is a warning)."""
    return "warning" if finding.code in GUARANTEE_WARNINGS else finding.severity.value


def _flagged(pitfalls: tuple[Finding, ...]) -> list[Finding]:
    """The findings the summary lists: errors and warnings, errors first."""
    shown = [p for p in pitfalls if severity(p) in _SHOWN]
    return sorted(shown, key=lambda p: severity(p) != "error")


def _stopping(result: TrainResult, strict: bool) -> list[Finding]:
    """The findings that set the exit code: errors; with ``strict``, guarantee warnings too."""
    return [
        p
        for p in result.pitfalls
        if severity(p) == "error" or (strict and p.code in GUARANTEE_WARNINGS)
    ]


def exit_code(result: TrainResult, strict: bool = False) -> int:
    """:data:`PITFALL_EXIT` on an ERROR pitfall (or, ``strict``, a guarantee WARN), else 0."""
    return PITFALL_EXIT if _stopping(result, strict) else 0


def _diagnostics(result: TrainResult) -> str | None:
    """The path of the run's diagnostics file, if it wrote one."""
    path = result.run_dir / "diagnostics.md"
    return str(path) if path.is_file() else None


def epsilon_covers(access: str, features_public: bool) -> str | None:
    """What ε protects when it is not the whole example (label-only DP), said beside ε."""
    if access != "label":
        return None
    if features_public:
        return "the labels only (the features were declared public: --features-public)"
    return (
        "the labels only: the features were NOT declared public and enter training without "
        "noise, unprotected (pass --features-public only if they are public, else --access full)"
    )


def _summary_lines(result: TrainResult, unit: str, covers: str | None = None) -> list[str]:
    """The short human summary: where the run is, its accuracy, its (ε, δ), its pitfalls."""
    lines = [
        f"run directory: {result.run_dir}",
        f"report: {result.run_dir / 'report.md'}",
    ]
    diagnostics = _diagnostics(result)
    if diagnostics is not None:
        lines.append(f"diagnostics (not for publication): {diagnostics}")
    lines.append(f"{result.accuracy_of}: {result.test_accuracy:.4f}")
    if result.baseline_accuracy is not None:
        lines.append(f"test accuracy (non-private): {result.baseline_accuracy:.4f}")
    resumed = "" if result.resumed_at is None else f", resumed at step {result.resumed_at}"
    released = result.released or f"{result.steps} steps"
    lines.append(
        f"ε spent: {result.epsilon:.4f} at δ = {result.delta:g} ({unit}-level, "
        f"{result.algorithm}, {released}{resumed})"
    )
    if covers is not None:
        lines.append(f"ε covers: {covers}")
    lines.append(f"time: {result.seconds:.1f} s")
    lines += [f"{_SHOWN[severity(p)]} {p.code}: {p.title}" for p in _flagged(result.pitfalls)]
    return lines


def _document(
    result: TrainResult, unit: str, strict: bool = False, covers: str | None = None
) -> dict[str, Any]:
    """The ``--json`` object: the run's figures, its pitfalls and the paths of what it wrote."""
    written = sorted(p for p in result.run_dir.iterdir() if p.is_file())
    return {
        "status": "finished",
        "run_dir": str(result.run_dir),
        "test_accuracy": result.test_accuracy,
        "baseline_accuracy": result.baseline_accuracy,
        "diagnostics": _diagnostics(result),
        "epsilon": _finite(result.epsilon),
        "delta": result.delta,
        "epsilon_covers": covers or "the whole example (features and label)",
        "unit": unit,
        "algorithm": result.algorithm,
        "steps": result.steps,
        "released": result.released or f"{result.steps} steps",
        "accuracy_of": result.accuracy_of,
        "resumed_at": result.resumed_at,
        "seconds": result.seconds,
        "pitfalls": [
            {"severity": severity(p), "code": p.code, "title": p.title} for p in result.pitfalls
        ],
        "paths": {path.name: str(path) for path in written},
        "exit_code": exit_code(result, strict),
    }


def print_result(
    result: TrainResult,
    unit: str,
    output: Output,
    *,
    strict: bool = False,
    covers: str | None = None,
) -> int:
    """Print the finished run as ``output`` asks; return the exit code (3 on an ERROR pitfall,
    or with ``strict`` on a guarantee WARN)."""
    code = exit_code(result, strict)
    if output is Output.json:
        typer.echo(json.dumps(_document(result, unit, strict, covers)))
    elif output is Output.quiet:
        typer.echo(str(result.run_dir))
    else:
        for line in _summary_lines(result, unit, covers):
            typer.echo(line)
    if code:
        stopping = _stopping(result, strict)
        errors = sum(severity(p) == "error" for p in stopping)
        what = (
            f"{errors} ERROR pitfall(s): the stated guarantee is not established as reported"
            if errors
            else f"{', '.join(p.code for p in stopping)} (WARN, and --strict was given)"
        )
        typer.echo(
            f"error: the report flags {what} (see {result.run_dir / 'report.md'}); exit code "
            f"{code}",
            err=True,
        )
    return code


def print_interrupted(stop: Interrupted, output: Output) -> None:
    """Say what an interrupted run spent and how to continue it (stderr, or the JSON object)."""
    if output is Output.json:
        typer.echo(
            json.dumps(
                {
                    "status": "interrupted",
                    "run_dir": str(stop.run_dir),
                    "steps_taken": stop.steps_taken,
                    "planned_steps": stop.planned_steps,
                    "epsilon": _finite(stop.epsilon),
                    "delta": stop.delta,
                    "report": str(stop.report),
                    "resume": f"dpfy train --resume {stop.run_dir}" if stop.resumable else None,
                }
            )
        )
        return
    typer.echo(f"{stop}; report of what was spent: {stop.report}", err=True)
