"""What ``dpfy tune`` does with its options: build the config, run, print the outcome."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from dpfy._validate import check_learning_rate, check_seed
from dpfy.jobs.config import check_epochs
from dpfy.tune.config import TuneConfig, check_tune_config, parse_grid
from dpfy.tune.pipeline import UNTUNED_LABEL, run_tuning


def _eps(value: float | None) -> str:
    """ε for the table."""
    return "—" if value is None else f"{value:.3f}"


def tune_command(
    *,
    dataset: str,
    search: str,
    trials: int,
    accounting: str | None,
    public_data: str | None,
    distribution: str,
    clip_grid: str,
    lr_grid: str,
    tolerance: float,
    target_epsilon: float,
    epochs: float,
    trial_epochs: float,
    optimizer: str = "adam",
    lr: float = 0.01,
    tuning_share: float | None = None,
    model: str = "mlp",
    batch_size: int = 128,
    delta: float | None = None,
    max_grad_norm: float = 1.0,
    out: Path | None = None,
    seed: int = 0,
    data_dir: Path | None = None,
    compare_default: bool = False,
    limit: int | None = None,
    quiet: bool = False,
    as_json: bool = False,
) -> dict[str, Any]:
    """Validate everything before loading data, run the tuning, print a summary table.

    The output directory is claimed like a training run's (new or empty, never shared; a fresh
    runs/tune-… one by default) and left as it was if the tuning fails before writing into it.
    ``compare_default`` also trains the untuned default on the private data; the ε printed is
    then the total of everything trained (its own ε included), and the table says so beside its
    accuracy. ``limit`` caps the examples per split (quick runs). The summary is plain lines
    (a table is cut to the terminal's width, 80 columns when piped, and paths with it);
    ``quiet`` prints only the output directory, ``as_json`` one JSON object.
    """
    from dpfy.jobs.run_dir import fresh_run_dir, release_run_dir

    check_seed(seed)
    check_epochs("epochs", epochs)
    check_epochs("trial_epochs", trial_epochs)
    check_learning_rate("lr", lr)
    config = TuneConfig(
        dataset=dataset, search=search, trials=trials, accounting=accounting,
        public_data=public_data, distribution=distribution, clip_grid=parse_grid(clip_grid),
        lr_grid=parse_grid(lr_grid), tolerance=tolerance, target_epsilon=target_epsilon,
        tuning_share=tuning_share, epochs=epochs, trial_epochs=trial_epochs, optimizer=optimizer,
        lr=lr, model=model, batch_size=batch_size, delta=delta, max_grad_norm=max_grad_norm,
        out=out, seed=seed, data_dir=data_dir, compare_default=compare_default, limit=limit,
    )  # fmt: skip
    check_tune_config(config)
    if config.out is None:  # a unique directory, so two runs started together never share one
        stamp = time.strftime("%Y%m%d-%H%M%S")
        config = replace(config, out=fresh_run_dir(Path("runs") / f"tune-{dataset}-{stamp}"))
    console = Console(soft_wrap=True, quiet=quiet or as_json)
    try:
        result = run_tuning(config, console)
    finally:
        release_run_dir(config.out)
    summary = result.summary
    if as_json:
        files = {name: str(path) for name, path in result.files.items()}
        document = {"status": "finished", "out": str(result.out), **summary, "paths": files}
        typer.echo(json.dumps(_json_ready(document)))
    elif quiet:
        typer.echo(str(result.out))
    else:
        for line in _summary_lines(summary, result.out, result.files):
            typer.echo(line)
    return summary


def _json_ready(value: Any) -> Any:
    """JSON has no infinity or NaN (null instead) and no paths (strings instead)."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value) if isinstance(value, Path) else value


def _summary_lines(summary: dict[str, Any], out: Path, files: dict[str, Path]) -> list[str]:
    """The printed outcome, one ``name: value`` line each, paths whole."""
    final, default = summary["final"], summary["untuned_default"]
    tuning = summary["tuning"]
    rows: list[tuple[str, str]] = []
    chosen = tuning["chosen"]
    rows.append((
        "chosen",
        "nothing (K = 0 runs drawn): untuned default used"
        if chosen is None
        else f"C = {chosen['max_grad_norm']:g}, lr = {chosen['lr']:g}",
    ))  # fmt: skip
    rows.append(("trials run", str(tuning["trials_run"])))
    rows.append(("test accuracy (tuned)", f"{final['test_accuracy']:.4f}"))
    eps = final["epsilon"]
    parts = ["training", "tuning"]
    if default is not None:  # a second model on the private data: its ε is in the total
        rows.append(("test accuracy (untuned default)", f"{default['test_accuracy']:.4f}"))
        parts.append(UNTUNED_LABEL)
    budget = f"budget {summary['budget']['total_epsilon']:g}"
    if default is not None:
        budget += (
            f" for tuning and the final run (composed: {_eps(final['budgeted_epsilon'])}); the "
            "untuned default (--compare-default) trained on the same private data too, so the "
            "total composes it"
        )
    rows.append((
        f"ε {' / '.join(p.replace('-', ' ') for p in parts)} / total",
        " / ".join(_eps(eps.get(p, 0.0)) for p in parts)
        + f" / {_eps(eps['total'])} at δ = {summary['delta']:g} ({final['accountant']}, "
        f"tuning by {tuning['accounting']['method']}); {budget}",
    ))  # fmt: skip
    rows += [(name, str(path)) for name, path in files.items()]
    return [f"dpfy tune → {out}", *(f"{name}: {value}" for name, value in rows)]


__all__ = ["tune_command"]
