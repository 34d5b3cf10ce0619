"""The ``dpfy`` command line: ``account``, ``plan``, ``train`` and ``report``.

``account`` and ``plan`` are a stable contract other tools build on: with ``--json`` each prints
exactly one JSON object on stdout. Bad input never shows a traceback: any ValueError becomes one
line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import warnings
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dpfy.accounting import RdpAccountant, dpsgd_event, make_accountant
from dpfy.accounting.calibrate import calibrate_noise_multiplier
from dpfy.run_config import OPTIMIZER_NAMES, TrainConfig

app = typer.Typer(
    name="dpfy",
    help="Train machine-learning models with differential privacy: plan, account, train, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

USAGE_ERROR = 2


class AccountantChoice(str, Enum):
    """The accountants the CLI offers."""

    pld = "pld"
    rdp = "rdp"


AccountantOption = Annotated[
    AccountantChoice,
    typer.Option(help="pld (tight, default) or rdp (Rényi DP, looser but classic)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")]
DeltaOption = Annotated[float, typer.Option(help="δ of the (ε, δ) guarantee, in (0, 1).")]


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Turn bad input into one line on stderr and exit code 2; show warnings as one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except ValueError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(USAGE_ERROR) from None
        finally:
            for warning in caught:
                typer.echo(f"warning: {warning.message}", err=True)


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unbounded ε is printed as null."""
    return value if math.isfinite(value) else None


def _emit(result: dict[str, object], title: str, as_json: bool) -> None:
    """Print a result as one JSON object, or as a short human-readable table."""
    if as_json:
        typer.echo(
            json.dumps({k: _finite(v) if isinstance(v, float) else v for k, v in result.items()})
        )
        return
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in result.items():
        shown = f"{value:.6g}" if isinstance(value, float) else str(value)
        table.add_row(key.replace("_", " "), shown)
    Console().print(table)


@app.command()
def account(
    sampling_rate: Annotated[float, typer.Option(help="Poisson sampling rate q = B / N.")],
    noise_multiplier: Annotated[float, typer.Option(help="Noise multiplier σ (std / clip norm).")],
    steps: Annotated[int, typer.Option(help="Number of DP-SGD steps.")],
    delta: DeltaOption,
    accountant: AccountantOption = AccountantChoice.pld,
    as_json: JsonOption = False,
) -> None:
    """ε spent by Poisson-sampled DP-SGD with the given q, σ and number of steps."""
    with _user_errors():
        event = dpsgd_event(sampling_rate, noise_multiplier, steps)
        tracker = make_accountant(accountant.value).compose(event)
        extra: dict[str, object] = {}
        if isinstance(tracker, RdpAccountant):
            details = tracker.epsilon_details(delta)
            epsilon, extra["rdp_order"] = details.epsilon, details.order
        else:
            epsilon = tracker.epsilon(delta)
        result: dict[str, object] = {
            "epsilon": epsilon,
            "delta": delta,
            "accountant": accountant.value,
            "sampling_rate": sampling_rate,
            "noise_multiplier": noise_multiplier,
            "steps": steps,
            **extra,
        }
        _emit(result, "DP-SGD privacy (add-or-remove adjacency, Poisson sampling)", as_json)


@app.command()
def plan(
    dataset_size: Annotated[int, typer.Option(help="Number of training examples N.")],
    batch_size: Annotated[int, typer.Option(help="Expected batch size B (q = B / N).")],
    epochs: Annotated[float, typer.Option(help="Passes over the data (steps = ⌈E·N/B⌉).")],
    target_epsilon: Annotated[float, typer.Option(help="The ε to meet.")],
    delta: DeltaOption,
    accountant: AccountantOption = AccountantChoice.pld,
    as_json: JsonOption = False,
) -> None:
    """The smallest noise multiplier σ that meets (ε, δ) for the given data, batch and epochs."""
    with _user_errors():
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be a whole number >= 1, got {dataset_size}")
        if not 1 <= batch_size <= dataset_size:
            raise ValueError(
                f"batch_size must lie in [1, dataset_size={dataset_size}], got {batch_size}"
            )
        if not (math.isfinite(epochs) and epochs > 0):
            raise ValueError(f"epochs must be a finite number > 0, got {epochs}")
        rate = batch_size / dataset_size
        steps = max(1, math.ceil(epochs * dataset_size / batch_size))
        sigma = calibrate_noise_multiplier(
            target_epsilon, delta, rate, steps, accountant=accountant.value
        )
        epsilon = (
            make_accountant(accountant.value)
            .compose(dpsgd_event(rate, sigma, steps))
            .epsilon(delta)
        )
        result = {
            "epsilon": epsilon,
            "delta": delta,
            "accountant": accountant.value,
            "noise_multiplier": sigma,
            "sampling_rate": rate,
            "steps": steps,
            "target_epsilon": target_epsilon,
        }
        _emit(result, "DP-SGD plan (add-or-remove adjacency, Poisson sampling)", as_json)


OptimizerChoice = Enum("OptimizerChoice", {name: name for name in OPTIMIZER_NAMES}, type=str)
_TRAIN = TrainConfig()
_OPTIMIZER = OptimizerChoice(_TRAIN.optimizer)


class ReportFormat(str, Enum):
    """Report renderings."""

    md = "md"
    json = "json"


@app.command()
def train(
    dataset: Annotated[str, typer.Option(help="digits, breast-cancer, fashion-mnist, …")] = (
        _TRAIN.dataset
    ),
    model: Annotated[str, typer.Option(help="logreg, mlp or cnn (GroupNorm CNN).")] = _TRAIN.model,
    target_epsilon: Annotated[float, typer.Option(help="The ε to spend.")] = _TRAIN.target_epsilon,
    delta: Annotated[
        float | None, typer.Option(help="δ; default: a power of ten at least 10× below 1/N.")
    ] = _TRAIN.delta,
    epochs: Annotated[float, typer.Option(help="Passes over the data.")] = _TRAIN.epochs,
    batch_size: Annotated[int, typer.Option(help="Expected batch size B.")] = _TRAIN.batch_size,
    max_grad_norm: Annotated[float, typer.Option(help="Clip norm C.")] = _TRAIN.max_grad_norm,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = _TRAIN.lr,
    optimizer: Annotated[OptimizerChoice, typer.Option(help="Torch optimizer.")] = _OPTIMIZER,
    out: Annotated[Path | None, typer.Option(help="Run directory (default: runs/…).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for init, sampling, noise.")] = _TRAIN.seed,
    baseline: Annotated[bool, typer.Option("--baseline", help="Also train non-privately.")] = False,
    data_dir: Annotated[Path | None, typer.Option(help="Where file datasets live.")] = None,
    engine: Annotated[str, typer.Option(help="Gradient engine: auto, fast, vmap.")] = _TRAIN.engine,
) -> None:
    """Train with DP-SGD on a bundled real dataset and write the privacy report card."""
    from dpfy.trainer import TrainConfig, run_training

    with _user_errors():
        if delta is not None and not (0 < delta < 1):
            raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
        config = TrainConfig(
            dataset=dataset, model=model, target_epsilon=target_epsilon, delta=delta,
            epochs=epochs, batch_size=batch_size, max_grad_norm=max_grad_norm, lr=lr,
            optimizer=optimizer.value, out=out, seed=seed, baseline=baseline,
            data_dir=data_dir, engine=engine,
        )  # fmt: skip
        console = Console()
        result = run_training(config, console)
        table = Table(title=f"Run {result.run_dir}", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        table.add_row("test accuracy (DP)", f"{result.test_accuracy:.4f}")
        if result.baseline_accuracy is not None:
            table.add_row("test accuracy (non-private)", f"{result.baseline_accuracy:.4f}")
        table.add_row("ε spent", f"{result.epsilon:.4f} at δ = {result.delta:g}")
        table.add_row("time", f"{result.seconds:.1f} s")
        console.print(table)
        console.print((result.run_dir / "report.md").read_text(), markup=False)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `dpfy train`.")],
    format: Annotated[ReportFormat, typer.Option(help="md or json.")] = ReportFormat.md,
) -> None:
    """Re-render a run's privacy report card from the facts it saved."""
    from dpfy.report import render_run

    with _user_errors():
        if not (run_dir / "facts.json").exists():
            raise ValueError(
                f"{run_dir} holds no dpfy run (no facts.json); pass a `dpfy train` run directory"
            )
        typer.echo(render_run(run_dir, format.value))


def main() -> None:
    """Console entry point."""
    app(prog_name="dpfy")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
