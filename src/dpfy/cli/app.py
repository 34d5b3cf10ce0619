"""The ``dpfy`` command line: ``account``, ``plan``, ``train`` and ``report``.

``account`` and ``plan`` are a stable contract other tools build on: with ``--json`` each prints
exactly one JSON object on stdout. Bad input never shows a traceback: any ValueError, and any
option the parser refuses, becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from dpfy import __version__
from dpfy.cli.audit_command import audit
from dpfy.cli.choices import choices
from dpfy.cli.finetune_command import finetune
from dpfy.cli.train_output import PITFALL_EXIT
from dpfy.federated.config import SERVER_OPTIMIZER_NAMES, FederatedConfig
from dpfy.jobs.config import (
    ACCESS_NAMES,
    ALGORITHM_NAMES,
    CONFIG_FILE,
    DATASET_NAMES,
    ENGINE_NAMES,
    LABEL_MECHANISM_NAMES,
    MAX_EPOCHS,
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    SAMPLER_NAMES,
    UNIT_NAMES,
    TrainConfig,
    check_config,
    default_user_batch,
    read_config,
)
from dpfy.plan.accounting import RdpAccountant, dpsgd_event, make_accountant
from dpfy.plan.accounting.calibrate import calibrate_noise_multiplier
from dpfy.plan.accounting.events import MAX_STEPS
from dpfy.train.cpu_allocator import keep_freed_memory
from dpfy.tune.names import (
    DISTRIBUTION_NAMES,
    SEARCH_NAMES,
    TUNING_DATASET_NAMES,
    TUNING_METHOD_NAMES,
)

USAGE_ERROR = 2
#: The exit code of a run stopped by Ctrl-C (128 + SIGINT); dpfy.jobs.outcome uses the same.
INTERRUPTED_EXIT = 130


def _usage_error(err: click.UsageError, ctx: click.Context | None) -> click.exceptions.Exit:
    """Print a parser refusal as one ``error:`` line pointing at the help; exit code 2."""
    where = err.ctx or ctx
    message = " ".join(err.format_message().split()).rstrip(".")
    help_hint = f"; see `{where.command_path} --help`" if where is not None else ""
    typer.echo(f"error: {message}{help_hint}", err=True)
    return click.exceptions.Exit(USAGE_ERROR)


class _OneLineErrors(TyperGroup):
    """Options the parser refuses (``--steps 1e30``) get one ``error:`` line too, not a panel."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        """Parse the top-level options (``dpfy --bogus`` is refused in one line)."""
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as err:
            raise _usage_error(err, None) from None

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; a usage error becomes one line on stderr and exit code 2."""
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as err:
            raise _usage_error(err, ctx) from None


app = typer.Typer(
    name="dpfy",
    help="Train machine-learning models with differential privacy: plan, account, train, report.",
    cls=_OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    """``--version``: the package version, then exit."""
    if value:
        typer.echo(f"dpfy {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Train machine-learning models with differential privacy: plan, account, train, report."""


class AccountantChoice(str, Enum):
    """The accountants the CLI offers."""

    pld = "pld"
    rdp = "rdp"


AccountantOption = Annotated[
    AccountantChoice,
    typer.Option(help="pld (tight, default) or rdp (Rényi DP, looser but classic)."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")]
QuietOption = Annotated[
    bool, typer.Option("--quiet", help="Print only the run directory (or the result's path).")
]
StrictOption = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Exit 3 on a WARN pitfall about the guarantee too (a seeded run), not only on ERROR.",
    ),
]
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
        except OSError as err:  # a full disk, a read-only directory: one line, not a traceback
            where = f" {err.filename}" if err.filename else ""
            typer.echo(
                f"error: cannot read or write{where} ({err.strerror or err}); check the path, "
                "free space or choose a writable --out — files already written are unchanged",
                err=True,
            )
            raise typer.Exit(USAGE_ERROR) from None
        finally:
            for warning in caught:
                typer.echo(f"warning: {warning.message}", err=True)


def _out_dir(out: str | None) -> Path | None:
    """``--out ""`` would mean the working directory: refused, never guessed."""
    if out is None:
        return None
    if not out.strip():
        raise ValueError("--out is empty; pass a directory for the run, or omit --out")
    return Path(out)


def _warn_if_unbounded(epsilon: float) -> None:
    """An infinite ε is a result, not a crash: say once, plainly, what it means."""
    if not math.isfinite(epsilon):
        warnings.warn(
            "ε is infinite: these settings give no (ε, δ) guarantee (the noise is too small "
            "for the number of steps); raise --noise-multiplier or lower --steps",
            stacklevel=2,
        )


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
    steps: Annotated[int, typer.Option(help=f"Number of DP-SGD steps (at most {MAX_STEPS:,}).")],
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
        _warn_if_unbounded(epsilon)
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
        try:
            passes = epochs * dataset_size / batch_size
        except OverflowError:  # a dataset size beyond any float
            passes = math.inf
        if passes > MAX_STEPS:
            raise ValueError(
                f"⌈epochs·N/B⌉ = {passes:.3g} steps exceeds the {MAX_STEPS:,} the accountants "
                "compose; lower --epochs or --dataset-size, or raise --batch-size"
            )
        steps = max(1, math.ceil(passes))
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


OptimizerChoice = choices("OptimizerChoice", OPTIMIZER_NAMES)
UnitChoice = choices("UnitChoice", UNIT_NAMES)
DatasetChoice = choices("DatasetChoice", DATASET_NAMES)
TuneDatasetChoice = choices("TuneDatasetChoice", TUNING_DATASET_NAMES)
ModelChoice = choices("ModelChoice", MODEL_NAMES)
EngineChoice = choices("EngineChoice", ENGINE_NAMES)
AlgorithmChoice = choices("AlgorithmChoice", ALGORITHM_NAMES)
SamplerChoice = choices("SamplerChoice", SAMPLER_NAMES)
AccessChoice = choices("AccessChoice", ACCESS_NAMES)
LabelMechanismChoice = choices("LabelMechanismChoice", LABEL_MECHANISM_NAMES)
SearchChoice = choices("SearchChoice", SEARCH_NAMES)
TuningMethodChoice = choices("TuningMethodChoice", TUNING_METHOD_NAMES)
DistributionChoice = choices("DistributionChoice", DISTRIBUTION_NAMES)
_SEARCH, _DISTRIBUTION = SearchChoice("clip"), DistributionChoice("poisson")
_TUNE_MODEL = ModelChoice("mlp")
_TUNE_DATASET = TuneDatasetChoice("digits")
_TRAIN = TrainConfig()
_OPTIMIZER = OptimizerChoice(_TRAIN.optimizer)
_DATASET, _MODEL = DatasetChoice(_TRAIN.dataset), ModelChoice(_TRAIN.model)
_ENGINE, _UNIT = EngineChoice(_TRAIN.engine), UnitChoice(_TRAIN.unit)
_ALGORITHM = AlgorithmChoice(_TRAIN.algorithm)
_ACCESS = AccessChoice(_TRAIN.access)
_LABEL_MECHANISM = LabelMechanismChoice(_TRAIN.label_mechanism)


class ReportFormat(str, Enum):
    """Report renderings."""

    md = "md"
    json = "json"


_SEED_HELP = (
    "Seed sampling and noise too, for reproducible experiments (the report then flags the run "
    "with a WARN: whoever knows the seed can replay the noise); 0 to 2**63 - 1. The only way to "
    "reproduce a run: torch.manual_seed does not reach sampling and noise. Default: OS "
    "entropy; init and splits use 0."
)
_BOUNDS = (  # "\\[": a literal bracket in help text, which rich would read as markup
    "LOW:HIGH (one public range for every feature, e.g. 0:255), FILE.json ({column: \\[low, "
    "high]}), as-is (already on a public scale), or fit (standardise on the training rows: "
    "flagged as fitted on the private data)"
)
_EPOCHS_BOUND = f"at most {MAX_EPOCHS}"
_OUT_HELP = "Run directory: new or empty, never shared (default: a fresh runs/…)."
_TRAIN_HELP = "\n\n".join(
    (
        "Train on a bundled dataset, or your own file (--data FILE --label COLUMN "
        "--feature-bounds SPEC), with DP-SGD, DP-FTRL, BandMF or BLT, and write the privacy "
        "report card.",
        "Prints a short summary (run directory, report path, accuracy, ε and δ, one line per "
        "WARN or ERROR pitfall); --quiet prints only the run directory, --json one JSON object. "
        "The whole report card, to publish, is in RUN_DIR/report.md; un-noised diagnostics of "
        "the private data (gradient norms, the --baseline accuracy) are in "
        "RUN_DIR/diagnostics.md, not for publication.",
        "--config RUN_DIR/config.json replays a run's settings (options given here override "
        "them; --out defaults to a fresh directory). Ctrl-C stops at a step boundary, leaving a "
        "checkpoint and a report of what was spent; --resume RUN_DIR continues it (other options "
        "must match the saved ones).",
        f"Exit codes: 0 done; 2 bad input; {PITFALL_EXIT} the run finished and wrote everything, "
        "but its report flags an ERROR pitfall (the stated guarantee is not established as "
        "reported, e.g. δ ≥ 1/N), or with --strict a WARN about the guarantee (a seed chose "
        f"the noise: an experiment, exit 0 without --strict); {INTERRUPTED_EXIT} interrupted "
        "(resumable).",
    )
)
#: train's parameters that are not settings of the run (and so never clash with a saved one).
_NOT_SETTINGS = ("resume", "force", "config_file", "quiet", "as_json", "strict")
#: Old option spellings kept working (hidden from --help): CLI parameter → the TrainConfig field.
_FIELD_OF = {"max_user_examples": "max_examples_per_user"}


def _given(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The settings typed on the command line (not defaults), by TrainConfig field name."""
    given = {}
    for name, value in values.items():
        if name in _NOT_SETTINGS:
            continue
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            given[_FIELD_OF.get(name, name)] = value.value if isinstance(value, Enum) else value
    if "out" in given:
        given["out"] = _out_dir(given["out"])
    return given


def _own_data(config: TrainConfig, given: dict[str, Any]) -> TrainConfig:
    """A new run on ``--data FILE``: named after the file, its model chosen from the data's shape.

    The features' declared scale is read here, so a missing or malformed --feature-bounds is
    refused before any run directory exists.
    """
    from dpfy.data.user_file import model_for_shape, parse_feature_bounds, peek_input_shape

    if config.data is None:
        return config
    if "dataset" in given:
        raise ValueError("pass --dataset NAME (a bundled dataset) or --data FILE, not both")
    if not config.label and not config.data.is_dir():  # a folder's labels are its subfolders
        raise ValueError("--data needs --label COLUMN: the column (or NPZ array) of the labels")
    parse_feature_bounds(config.feature_bounds)
    shape = peek_input_shape(config.data, config.label or "")
    model = given.get("model") or model_for_shape(shape)
    return replace(config, dataset=config.data.name, model=model)


def _merge_alias(ctx: click.Context, values: dict[str, Any], alias: str, name: str) -> None:
    """An old spelling (hidden option ``alias``) stands for ``name``; both given is refused."""
    if ctx.get_parameter_source(alias) is not click.core.ParameterSource.COMMANDLINE:
        values.pop(alias, None)
        return
    if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
        raise ValueError(
            f"--{alias.replace('_', '-')} is the old spelling of --{name.replace('_', '-')}; "
            "pass one of them"
        )
    values[name] = values.pop(alias)
    ctx.set_parameter_source(name, click.core.ParameterSource.COMMANDLINE)


def _resumed_config(run_dir: Path, given: dict[str, Any]) -> TrainConfig:
    """The saved settings of ``run_dir``; an option given besides --resume must match them."""
    if not (run_dir / CONFIG_FILE).is_file():
        raise ValueError(
            f"--resume {run_dir} holds no {CONFIG_FILE}: it is not a `dpfy train` run "
            "directory; pass the directory an interrupted `dpfy train` wrote"
        )
    saved = read_config(run_dir / CONFIG_FILE)
    if "out" in given and Path(os.path.abspath(given["out"])) != Path(os.path.abspath(run_dir)):
        raise ValueError(f"--out with --resume: the run continues in {run_dir}; drop --out")
    clashes = [
        f"--{name.replace('_', '-')} {value} (saved: {getattr(saved, name)})"
        for name, value in given.items()
        if name != "out" and getattr(saved, name) != value
    ]
    if clashes:
        raise ValueError(
            f"--resume continues the run with its saved settings ({run_dir / CONFIG_FILE}), but "
            f"{', '.join(clashes)} differ; drop those options, or start a new run with "
            f"--config {run_dir / CONFIG_FILE} and them"
        )
    return saved


def _train_config(
    ctx: click.Context, values: dict[str, Any], resume: Path | None, config_file: Path | None
) -> TrainConfig:
    """The run's settings: typed options over defaults, over a replayed config, or a resume's."""
    given = _given(ctx, values)
    if resume is not None and config_file is not None:
        raise ValueError(
            "pass --resume RUN_DIR (continue a run) or --config FILE (start one), not both"
        )
    if resume is not None:
        config = _resumed_config(resume, given)
    elif config_file is not None:
        config = replace(read_config(config_file), **{"out": None, **given})
    else:
        config = _own_data(replace(_TRAIN, **given), given)
        if config.unit == "user" and "batch_size" not in given:
            config = replace(config, batch_size=default_user_batch(config.users))
    if config.delta is not None and not (0 < config.delta < 1):
        raise ValueError(f"delta must lie in (0, 1), got {config.delta!r}")
    check_config(config)  # refused before any directory is made
    return config


@app.command(help=_TRAIN_HELP)
def train(
    ctx: typer.Context,
    dataset: Annotated[DatasetChoice, typer.Option(help="Bundled dataset.")] = _DATASET,
    model: Annotated[ModelChoice, typer.Option(help="Model (cnn: GroupNorm CNN).")] = _MODEL,
    target_epsilon: Annotated[float, typer.Option(help="The ε to spend.")] = _TRAIN.target_epsilon,
    delta: Annotated[
        float | None, typer.Option(help="δ; default: a power of ten at least 10× below 1/N.")
    ] = _TRAIN.delta,
    epochs: Annotated[float, typer.Option(help=f"Passes over the data ({_EPOCHS_BOUND}).")] = (
        _TRAIN.epochs
    ),
    batch_size: Annotated[
        int, typer.Option(help="Expected batch size B (--unit user: users per step, users/5).")
    ] = _TRAIN.batch_size,
    max_grad_norm: Annotated[float, typer.Option(help="Clip norm C.")] = _TRAIN.max_grad_norm,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = _TRAIN.lr,
    optimizer: Annotated[OptimizerChoice, typer.Option(help="Torch optimizer.")] = _OPTIMIZER,
    out: Annotated[str | None, typer.Option(help=_OUT_HELP)] = None,
    seed: Annotated[int | None, typer.Option(help=_SEED_HELP)] = _TRAIN.seed,
    baseline: Annotated[
        bool,
        typer.Option(
            "--baseline", help="Also train non-privately (its accuracy: terminal, diagnostics.md)."
        ),
    ] = False,
    data_dir: Annotated[Path | None, typer.Option(help="Where file datasets live.")] = None,
    engine: Annotated[EngineChoice, typer.Option(help="Per-example gradient engine.")] = _ENGINE,
    unit: Annotated[
        UnitChoice,
        typer.Option(
            help="Unit of privacy: example, or user (simulated skewed users; "
            "--batch-size then counts users per step)."
        ),
    ] = _UNIT,
    users: Annotated[int, typer.Option(help="Simulated users (with --unit user).")] = _TRAIN.users,
    max_examples_per_user: Annotated[
        int | None, typer.Option(help="Cap on a sampled user's examples per step (--unit user).")
    ] = _TRAIN.max_examples_per_user,
    max_user_examples: Annotated[
        int | None, typer.Option(hidden=True, help="Old spelling of --max-examples-per-user.")
    ] = None,
    algorithm: Annotated[
        AlgorithmChoice,
        typer.Option(
            help="dp-sgd; or, with no sampling assumption, dp-ftrl (tree noise), bandmf or "
            "blt (matrix-factorisation noise over one batch order repeated every epoch)."
        ),
    ] = _ALGORITHM,
    sampler: Annotated[
        SamplerChoice | None,
        typer.Option(
            help="How batches are drawn, where the algorithm offers a choice: dp-sgd poisson "
            "(default), truncated-poisson (static batch shape, needs --max-batch-size), "
            "balls-in-bins (every example once per epoch; accounted as random allocation), "
            "shuffle (NOT Poisson: ε unproven, the card "
            "gives a lower bound) or fixed-size; dp-ftrl shuffle (default) or fixed-order; "
            "bandmf fixed-order (default) or cyclic-poisson (amplified BandMF); blt fixed-order."
        ),
    ] = None,
    max_batch_size: Annotated[
        int | None,
        typer.Option(
            help="--sampler truncated-poisson: M, the rows of every padded batch (a batch of "
            "more than M examples keeps M; the chance of that is charged in δ)."
        ),
    ] = None,
    bands: Annotated[
        int | None, typer.Option(help="--algorithm bandmf: bands of the strategy (default 16).")
    ] = None,
    buffers: Annotated[
        int | None, typer.Option(help="--algorithm blt: buffers of the strategy (default 4).")
    ] = None,
    access: Annotated[
        AccessChoice,
        typer.Option(
            help="Where DP applies: full (DP-SGD), label (labels only), input (each record), "
            "prediction (only the served answers of a private ensemble)."
        ),
    ] = _ACCESS,
    label_mechanism: Annotated[
        LabelMechanismChoice, typer.Option(help="--access label: rr, or rr-prior (in stages).")
    ] = _LABEL_MECHANISM,
    stages: Annotated[int, typer.Option(help="--label-mechanism rr-prior: stages.")] = 1,
    features_public: Annotated[
        bool, typer.Option("--features-public", help="Declare the features public (label DP).")
    ] = False,
    data: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE",
            help="Train on your own data instead of a bundled dataset: a .csv (header row, "
            "numeric features), .npz (a feature array and a label array) or .parquet file "
            "(needs --label), or a folder of class subfolders of images; and --feature-bounds. "
            "The model (unless --model) follows the data's shape: images a CNN, rows an MLP.",
        ),
    ] = None,
    label: Annotated[
        str | None, typer.Option(metavar="COLUMN", help="--data: the label column (NPZ: array).")
    ] = None,
    feature_bounds: Annotated[
        str | None, typer.Option(metavar="SPEC", help=f"--data: the features' scale: {_BOUNDS}.")
    ] = None,
    test_data: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", help="--data: test rows in a second file (default: 80/20 split)."
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(metavar="RUN_DIR", help="Continue this interrupted run from its checkpoint."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="With --resume: take over a run whose status still names a process that is "
            "gone (killed on another host, or its PID reused).",
        ),
    ] = False,
    config_file: Annotated[
        Path | None,
        typer.Option("--config", metavar="FILE", help="Replay a run's config.json."),
    ] = None,
    strict: StrictOption = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    from dpfy.cli.train_output import Output, epsilon_covers, print_interrupted, print_result
    from dpfy.jobs.access import access_job
    from dpfy.jobs.outcome import Interrupted

    values = {k: v for k, v in locals().items() if k in ctx.params}
    output = Output.json if as_json else Output.quiet if quiet else Output.summary
    with _user_errors():
        if quiet and as_json:
            raise ValueError("pass --quiet or --json, not both")
        _merge_alias(ctx, values, "max_user_examples", "max_examples_per_user")
        config = _train_config(ctx, values, resume, config_file)
        console = Console(soft_wrap=True, quiet=output is not Output.summary)
        if force:
            from dpfy.jobs.checkpoint import force_takeover

            force_takeover(resume)
        try:
            result = access_job(config.access)(config, console, resume=resume)
        except Interrupted as stop:
            print_interrupted(stop, output)
            raise typer.Exit(INTERRUPTED_EXIT) from None
    if result.rank != 0:  # under torchrun, rank 0 prints the run
        return
    covers = epsilon_covers(config.access, config.features_public)
    code = print_result(result, config.unit, output, strict=strict, covers=covers)
    if code:
        raise typer.Exit(code)


def _no_facts(run_dir: Path) -> str:
    """Why ``run_dir`` cannot be re-rendered: a tuning directory (its run is in final/), not a
    run, or a run of another access model."""
    final = run_dir / "final"
    if (final / "facts.json").is_file():
        return (
            f"{run_dir} is a `dpfy tune` directory: its trained model's run is {final}; run "
            f"`dpfy report {final}` (the tuning's own summary is in {run_dir})"
        )
    try:
        access = json.loads((run_dir / CONFIG_FILE).read_text()).get("access", "full")
    except (OSError, ValueError, AttributeError):
        access = "full"
    if access != "full" and (run_dir / "report.md").is_file():
        return (
            f"{run_dir} is a --access {access} run: its report card is {run_dir / 'report.md'} "
            "(dpfy report re-renders DP-SGD runs, from their facts.json)"
        )
    return f"{run_dir} holds no dpfy run (no facts.json); pass a `dpfy train` run directory"


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `dpfy train`.")],
    format: Annotated[ReportFormat, typer.Option(help="md or json.")] = ReportFormat.md,
    as_json: Annotated[bool, typer.Option("--json", help="Same as --format json.")] = False,
    diagnostics: Annotated[
        bool,
        typer.Option(
            "--diagnostics",
            help="Print the run's un-noised diagnostics of the private data instead of its card "
            "(diagnostics.md: not for publication).",
        ),
    ] = False,
) -> None:
    """Re-render a run's privacy report card (or its diagnostics) from the facts it saved."""
    from dpfy.report.render import render_run

    with _user_errors():
        if not (run_dir / "facts.json").exists():
            raise ValueError(_no_facts(run_dir))
        shown = ReportFormat.json if as_json else format
        typer.echo(render_run(run_dir, shown.value, diagnostics=diagnostics))


@app.command()
def tune(
    dataset: Annotated[
        TuneDatasetChoice,
        typer.Option(
            help="Bundled dataset; rotten-tomatoes: MiniLM features (with --model logreg)."
        ),
    ] = _TUNE_DATASET,
    search: Annotated[
        SearchChoice, typer.Option(help="clip (ClipSearch), lr-clip (grid) or random.")
    ] = _SEARCH,
    trials: Annotated[
        int, typer.Option(help="random: configs drawn; random-trials: mean number of runs.")
    ] = 5,
    tuning_accounting: Annotated[
        TuningMethodChoice | None,
        typer.Option(help="How the tuning's privacy cost is accounted (required)."),
    ] = None,
    public_data: Annotated[
        str | None, typer.Option(help="Declaration of the public tuning data (for public).")
    ] = None,
    distribution: Annotated[
        DistributionChoice, typer.Option(help="random-trials: how the number of runs is drawn.")
    ] = _DISTRIBUTION,
    clip_grid: Annotated[
        str, typer.Option(help="Grid of C, comma-separated (clip; lr-clip's C axis).")
    ] = "0.1,0.3,1,3,10",
    lr_grid: Annotated[str, typer.Option(help="lr-clip: learning rates.")] = "0.001,0.01,0.1",
    tolerance: Annotated[float, typer.Option(help="ClipSearch relative tolerance, (0, 1).")] = 0.02,
    target_epsilon: Annotated[
        float, typer.Option(help="Total ε budget: tuning and the final run composed, at most it.")
    ] = 3.0,
    tuning_share: Annotated[
        float | None,
        typer.Option(
            help="Fraction of the budget the trials may spend, in (0, 1); default: trials at "
            "the final run's σ."
        ),
    ] = None,
    delta: Annotated[
        float | None, typer.Option(help="δ; default: a power of ten at least 10× below 1/N.")
    ] = None,
    model: Annotated[ModelChoice, typer.Option(help="Model to train.")] = _TUNE_MODEL,
    batch_size: Annotated[
        int, typer.Option(help="Expected batch size B (trials, final run).")
    ] = 128,
    max_grad_norm: Annotated[float, typer.Option(help="Clip norm C of the untuned default.")] = 1.0,
    epochs: Annotated[float, typer.Option(help=f"Epochs of the final run ({_EPOCHS_BOUND}).")] = 20,
    trial_epochs: Annotated[
        float, typer.Option(help=f"Epochs of each tuning trial ({_EPOCHS_BOUND}).")
    ] = 2,
    optimizer: Annotated[OptimizerChoice, typer.Option(help="Torch optimizer.")] = _OPTIMIZER,
    lr: Annotated[float, typer.Option(help="Learning rate (ClipSearch, the default).")] = 0.01,
    out: Annotated[
        str | None, typer.Option(help="Output directory: new or empty (default: runs/tune-…).")
    ] = None,
    seed: Annotated[int | None, typer.Option(help=_SEED_HELP)] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where file datasets live.")] = None,
    compare_default: Annotated[
        bool,
        typer.Option(
            "--compare-default",
            help="Also train the untuned configuration (--lr, --max-grad-norm) at the whole "
            "budget on the same private data, for comparison; its ε is composed into the printed "
            "total and the report.",
        ),
    ] = False,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Tune hyperparameters under privacy (guide §5.4), train the choice, report both costs."""
    from dpfy.tune.command import tune_command

    with _user_errors():
        if quiet and as_json:
            raise ValueError("pass --quiet or --json, not both")
        tune_command(
            dataset=dataset.value, search=search.value, trials=trials,
            accounting=None if tuning_accounting is None else tuning_accounting.value,
            public_data=public_data, distribution=distribution.value, clip_grid=clip_grid,
            lr_grid=lr_grid, tolerance=tolerance, target_epsilon=target_epsilon,
            tuning_share=tuning_share, delta=delta, model=model.value, batch_size=batch_size,
            max_grad_norm=max_grad_norm, epochs=epochs, trial_epochs=trial_epochs,
            optimizer=optimizer.value, lr=lr, out=_out_dir(out), seed=seed, data_dir=data_dir,
            compare_default=compare_default, quiet=quiet, as_json=as_json,
        )  # fmt: skip


_FED = FederatedConfig()
ServerOptimizerChoice = choices("ServerOptimizerChoice", SERVER_OPTIMIZER_NAMES)
_FED_DATASET, _FED_MODEL = DatasetChoice(_FED.dataset), ModelChoice(_FED.model)
_FED_SERVER = ServerOptimizerChoice(_FED.server_optimizer)


@app.command()
def federated(
    dataset: Annotated[DatasetChoice, typer.Option(help="Bundled dataset.")] = _FED_DATASET,
    model: Annotated[ModelChoice, typer.Option(help="Model (cnn: GroupNorm CNN).")] = _FED_MODEL,
    users: Annotated[
        int, typer.Option(help="Simulated users (skewed non-IID split).")
    ] = _FED.users,
    alpha: Annotated[
        float, typer.Option(help="Dirichlet label skew (small = skewed).")
    ] = _FED.alpha,
    clients_per_round: Annotated[
        int, typer.Option(help="Expected users per round B_c.")
    ] = _FED.clients_per_round,
    rounds: Annotated[int, typer.Option(help="Rounds T.")] = _FED.rounds,
    local_steps: Annotated[
        int, typer.Option(help="Local SGD steps K (1 = FedSGD).")
    ] = _FED.local_steps,
    local_batch_size: Annotated[
        int, typer.Option(help="Local batch B_m of each local step; 0: all of the user's data.")
    ] = _FED.local_batch_size or 0,
    client_lr: Annotated[float, typer.Option(help="Client learning rate η_c.")] = _FED.client_lr,
    server_lr: Annotated[float, typer.Option(help="Server learning rate η_s.")] = _FED.server_lr,
    server_optimizer: Annotated[
        ServerOptimizerChoice, typer.Option(help="Server optimizer on the noised mean change.")
    ] = _FED_SERVER,
    max_grad_norm: Annotated[
        float, typer.Option(help="Clip norm C of each user's model change.")
    ] = _FED.clip_norm,
    clip_norm: Annotated[
        float | None, typer.Option(hidden=True, help="Old spelling of --max-grad-norm.")
    ] = None,
    target_epsilon: Annotated[
        float, typer.Option(help="User-level ε to spend.")
    ] = _FED.target_epsilon,
    delta: Annotated[
        float | None, typer.Option(help="δ; default: a power of ten at least 10× below 1/users.")
    ] = None,
    seed: Annotated[int | None, typer.Option(help=_SEED_HELP)] = _FED.seed,
    out: Annotated[str | None, typer.Option(help=_OUT_HELP)] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where file datasets live.")] = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Train with DP-FedAvg over simulated users (user-level DP) and write the report card."""
    from dpfy.federated.experiment import federated_command

    with _user_errors():
        if quiet and as_json:
            raise ValueError("pass --quiet or --json, not both")
        if clip_norm is not None:
            if max_grad_norm != _FED.clip_norm:
                raise ValueError(
                    "--clip-norm is the old spelling of --max-grad-norm; pass one of them"
                )
            max_grad_norm = clip_norm
        if local_batch_size < 0:
            raise ValueError(
                f"local_batch_size must be >= 1, or 0 for all of a user's data; got "
                f"{local_batch_size}"
            )
        console = Console(soft_wrap=True, quiet=quiet or as_json)
        result = federated_command(
            console, dataset=dataset.value, model=model.value, users=users, alpha=alpha,
            clients_per_round=clients_per_round, rounds=rounds, local_steps=local_steps,
            local_batch_size=local_batch_size or None, client_lr=client_lr, server_lr=server_lr,
            server_optimizer=server_optimizer.value, clip_norm=max_grad_norm,
            target_epsilon=target_epsilon, delta=delta, seed=seed, out=_out_dir(out),
            data_dir=data_dir,
        )  # fmt: skip
    if quiet:
        typer.echo(str(result.run_dir))
    elif as_json:
        typer.echo(json.dumps(_run_document(result, seeded=seed is not None)))


def _run_document(result: Any, **extra: object) -> dict[str, object]:
    """A finished run as one JSON object: its figures and the paths of the files it wrote."""
    run_dir = Path(result.run_dir)
    figures = {
        key: _finite(value) if isinstance(value, float) else value
        for key, value in vars(result).items()
        if isinstance(value, (int, float, str, type(None))) and not isinstance(value, bool)
    }
    written = sorted(p for p in run_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    return {
        "status": "finished",
        "run_dir": str(run_dir),
        **figures,
        **extra,
        "paths": {path.name: str(path) for path in written},
    }


app.command(name="finetune")(finetune)
app.command(name="audit")(audit)


def main() -> None:
    """Console entry point: the command's own process keeps freed CPU memory for reuse.

    Training steps allocate and free the same large temporaries; the CLI owns its process, so it
    asks malloc to keep them (``DPFY_KEEP_FREED_MEMORY=0`` leaves malloc alone).
    """
    keep_freed_memory()
    signal.signal(signal.SIGTERM, _terminate)
    app(prog_name="dpfy")


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (a scheduler, a container stop, ``kill``) stops every command like Ctrl-C; a
    training loop defers it to the end of its step (:mod:`dpfy.jobs.loop`)."""
    raise KeyboardInterrupt


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
