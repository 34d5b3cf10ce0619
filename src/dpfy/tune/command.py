"""What ``dpfy tune`` does with its options: build the config, run, print the outcome."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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
) -> dict[str, Any]:
    """Validate everything before loading data, run the tuning, print a summary table.

    The output directory is claimed like a training run's (new or empty, never shared; a fresh
    runs/tune-… one by default) and left as it was if the tuning fails before writing into it.
    ``compare_default`` also trains the untuned default on the private data; the ε printed is
    then the total of everything trained (its own ε included), and the table says so beside its
    accuracy. ``limit`` caps the examples per split (quick runs).
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
    console = Console()
    try:
        result = run_tuning(config, console)
    finally:
        release_run_dir(config.out)
    summary = result.summary
    final, default = summary["final"], summary["untuned_default"]
    tuning = summary["tuning"]
    table = Table(title=f"dpfy tune → {result.out}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    chosen = tuning["chosen"]
    table.add_row(
        "chosen",
        "nothing (K = 0 runs drawn): untuned default used"
        if chosen is None
        else f"C = {chosen['max_grad_norm']:g}, lr = {chosen['lr']:g}",
    )
    table.add_row("trials run", str(tuning["trials_run"]))
    table.add_row("test accuracy (tuned)", f"{final['test_accuracy']:.4f}")
    eps = final["epsilon"]
    parts = ["training", "tuning"]
    if default is not None:  # a second model on the private data: its ε is in the total
        table.add_row("test accuracy (untuned default)", f"{default['test_accuracy']:.4f}")
        parts.append(UNTUNED_LABEL)
    budget = f"budget {summary['budget']['total_epsilon']:g}"
    if default is not None:
        budget += (
            f" for tuning and the final run (composed: {_eps(final['budgeted_epsilon'])}); the "
            "untuned default (--compare-default) trained on the same private data too, so the "
            "total composes it"
        )
    table.add_row(
        f"ε {' / '.join(p.replace('-', ' ') for p in parts)} / total",
        " / ".join(_eps(eps.get(p, 0.0)) for p in parts)
        + f" / {_eps(eps['total'])} at δ = {summary['delta']:g} ({final['accountant']}, "
        f"tuning by {tuning['accounting']['method']}); {budget}",
    )
    for name, path in result.files.items():
        table.add_row(name, str(path))
    console.print(table)
    return summary


__all__ = ["tune_command"]
