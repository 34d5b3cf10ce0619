"""``dpfy finetune``: DP fine-tuning of a public pretrained encoder on Rotten Tomatoes.

The command only parses options into a :class:`~dpfy.jobs.finetune_config.FinetuneConfig`; the
job (:mod:`dpfy.jobs.finetune`, imported when the command runs, so ``dpfy --help`` stays quick
and never imports transformers) does the rest. Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import click
import typer

from dpfy.cli.choices import choices
from dpfy.jobs.finetune_config import FINETUNE_OPTIMIZERS, FinetuneConfig, check_finetune_config

if TYPE_CHECKING:
    from dpfy.jobs.finetune import FinetuneResult

__all__ = ["finetune"]

_DEFAULT = FinetuneConfig()
FinetuneOptimizer = choices("FinetuneOptimizer", FINETUNE_OPTIMIZERS)
_OPTIMIZER = FinetuneOptimizer(_DEFAULT.optimizer)
_USAGE_ERROR = 2
_OUT_HELP = "Run directory (new or empty); default runs/finetune-<model>-<mode>-eps<ε>-<time>."
_SEED_HELP = "Seed sampling and noise (experiments only: the report flags a seeded run)."
_MODE_HELP = (
    "What trains: head (linear head on cached features), last-N (top N layers + head, lower "
    "layers cached), lora (low-rank adapters through the whole model), full (everything)."
)


def _summary(result: FinetuneResult) -> str:
    """The lines printed when the run ends: accuracy, baseline, ε and where the report is.

    The non-private baseline is shown here, on the user's own terminal, and kept in the
    diagnostics file (not for publication), never on the card.
    """
    baseline = result.baseline_accuracy
    return "\n".join(
        [
            f"test accuracy {result.test_accuracy:.4f}"
            + ("" if baseline is None else f" · non-private baseline {baseline:.4f}"),
            f"ε = {result.epsilon:.4g} at δ = {result.delta:g}",
            f"report: {result.run_dir}/report.md",
            f"diagnostics (not for publication): {result.run_dir}/diagnostics.md",
        ]
    )


def _checked_mode(value: str) -> str:
    """``--mode`` is head, full, lora or last-N, refused by name while the options are parsed."""
    try:
        check_finetune_config(FinetuneConfig(mode=value))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="'--mode'") from None
    return value


def _document(result: FinetuneResult) -> str:
    """``--json``: the run's figures and where its files are."""

    def finite(value: float | None) -> float | None:
        return value if value is None or math.isfinite(value) else None

    run_dir = result.run_dir
    return json.dumps(
        {
            "status": "finished",
            "run_dir": None if run_dir is None else str(run_dir),
            "test_accuracy": result.test_accuracy,
            "baseline_accuracy": result.baseline_accuracy,
            "epsilon": finite(result.epsilon),
            "delta": result.delta,
            "seconds": result.seconds,
            "report": None if run_dir is None else str(run_dir / "report.md"),
            "diagnostics": None if run_dir is None else str(run_dir / "diagnostics.md"),
        }
    )


def finetune(
    mode: Annotated[str, typer.Option(help=_MODE_HELP, callback=_checked_mode)] = _DEFAULT.mode,
    target_epsilon: Annotated[float, typer.Option(help="The ε to spend.")] = 8.0,
    delta: Annotated[
        float | None, typer.Option(help="δ; default: a power of ten at least 10× below 1/N.")
    ] = None,
    epochs: Annotated[float, typer.Option(help="Passes over the data.")] = _DEFAULT.epochs,
    batch_size: Annotated[int, typer.Option(help="Expected batch size B.")] = _DEFAULT.batch_size,
    max_grad_norm: Annotated[float, typer.Option(help="Clip norm C.")] = _DEFAULT.max_grad_norm,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = _DEFAULT.lr,
    optimizer: Annotated[FinetuneOptimizer, typer.Option(help="Torch optimizer.")] = _OPTIMIZER,
    lora_rank: Annotated[int, typer.Option(help="LoRA rank r (--mode lora).")] = 8,
    max_length: Annotated[int, typer.Option(help="Tokens per snippet.")] = _DEFAULT.max_length,
    model_dir: Annotated[
        Path | None,
        typer.Option(help="A local Hugging Face model directory instead of bundled MiniLM."),
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="A folder holding rotten_tomatoes_corpus_full.csv.bz2.")
    ] = None,
    out: Annotated[str | None, typer.Option(help=_OUT_HELP)] = None,
    seed: Annotated[int | None, typer.Option(help=_SEED_HELP)] = None,
    baseline: Annotated[
        bool, typer.Option("--baseline", help="Also train the same schedule non-privately.")
    ] = False,
    limit: Annotated[
        int | None, typer.Option(help="Keep the first N examples of each split (quick checks).")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="Print only the run directory.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
) -> None:
    """DP fine-tuning of MiniLM on Rotten Tomatoes (or your encoder), with a report card."""
    from rich.console import Console

    from dpfy.jobs.finetune import run_finetune

    if out is not None and not out.strip():
        typer.echo("error: --out is empty; pass a directory for the run, or omit --out", err=True)
        raise typer.Exit(_USAGE_ERROR)
    if quiet and as_json:
        typer.echo("error: pass --quiet or --json, not both", err=True)
        raise typer.Exit(_USAGE_ERROR)
    config = FinetuneConfig(
        mode=mode, target_epsilon=target_epsilon, delta=delta, epochs=epochs,
        batch_size=batch_size, max_grad_norm=max_grad_norm, lr=lr, optimizer=optimizer.value,
        lora_rank=lora_rank, max_length=max_length, model_dir=model_dir, data_dir=data_dir,
        out=None if out is None else Path(out), seed=seed, baseline=baseline, limit=limit,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = run_finetune(config, Console(soft_wrap=True, quiet=quiet or as_json))
        except ValueError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(_USAGE_ERROR) from None
        finally:
            for warning in caught:
                if issubclass(warning.category, UserWarning):
                    typer.echo(f"warning: {warning.message}", err=True)
    if as_json:
        typer.echo(_document(result))
    elif quiet:
        typer.echo(str(result.run_dir))
    else:
        typer.echo(_summary(result))
