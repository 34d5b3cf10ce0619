"""The main job: train a bundled model on a bundled real dataset with DP-SGD, end with a report.

:func:`run_training` is what ``dpfy train`` runs: load the dataset, build the model, make it
private (σ calibrated for the target ε), train with a progress bar showing loss, accuracy and ε,
evaluate, optionally train a non-private baseline for comparison, and write the run directory:
``report.md``, ``report.json``, ``facts.json``, ``history.json``, ``config.json``, ``model.pt``
and the plots. The run first claims that directory (:mod:`dpfy.jobs.run_dir`): it must be new or
empty, so a run never overwrites files it did not write and two runs never share one directory.
While it trains it keeps a checkpoint there (:mod:`dpfy.jobs.checkpoint`); Ctrl-C stops it at a
step boundary with a checkpoint and a report of what was spent, and ``resume=RUN_DIR`` continues
it (:mod:`dpfy.jobs.outcome` writes both endings).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

from dpfy._safe_io import write_failed
from dpfy.data.datasets import LoadedDataset, load_dataset
from dpfy.data.users import UserSplit, split_users
from dpfy.jobs.checkpoint import (
    JobState,
    claim_for_resume,
    load_checkpoint,
    restore_status,
    save_checkpoint,
)
from dpfy.jobs.config import TrainConfig, check_config, public_seed
from dpfy.jobs.loop import (
    TrainingStopped,
    accuracy,
    algorithm_label,
    banner,
    deferred_interrupts,
    train_private,
)
from dpfy.jobs.progress_bars import baseline_progress
from dpfy.jobs.run_dir import claim_run_dir, release_run_dir
from dpfy.train.builder import make_private
from dpfy.train.distributed import (
    ProcessGroupReplicas,
    SingleProcess,
    current_replicas,
    launched_process_group,
)
from dpfy.train.models import build_model
from dpfy.train.session import PrivateTraining

if TYPE_CHECKING:
    from dpfy.report.pitfalls import Finding

__all__ = [
    "OPTIMIZERS",
    "TrainConfig",
    "TrainResult",
    "accuracy",
    "check_config",
    "fresh_model",
    "run_training",
    "train_baseline",
    "train_private",
]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "adagrad": lambda params, lr: torch.optim.Adagrad(params, lr=lr),
}


class ModelChoice(Protocol):
    """What a run's model and optimizer are built from (train and tuning configs alike)."""

    model: str
    optimizer: str
    lr: float
    seed: int | None


class DataShape(Protocol):
    """What the model's input and output layers are sized from."""

    input_shape: tuple[int, ...]
    num_classes: int


def fresh_model(config: ModelChoice, data: DataShape) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The run's model, initialised from its public seed, and its torch optimizer.

    Every run (private, baseline, tuning trial, final run) starts from the same initialisation
    for the same seed, so their accuracies compare like for like.
    """
    torch.manual_seed(public_seed(config.seed))
    model = build_model(config.model, data.input_shape, data.num_classes)
    return model, OPTIMIZERS[config.optimizer](model.parameters(), config.lr)


@dataclass
class TrainResult:
    """What the run produced: its directory, accuracies, ε and the history of evaluations."""

    run_dir: Path
    test_accuracy: float
    baseline_accuracy: float | None
    epsilon: float
    delta: float
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    rank: int = 0  # under torchrun, only rank 0 wrote the run directory
    pitfalls: tuple[Finding, ...] = ()  # what the report card flags, errors first
    steps: int = 0
    resumed_at: int | None = None  # the step a resumed run continued from
    algorithm: str = "DP-SGD"  # the algorithm that ran, as the banner names it
    #: What was released, for runs that take no steps (e.g. "1437 labels randomised once");
    #: None: the ``steps`` a DP-SGD run took.
    released: str | None = None
    accuracy_of: str = "test accuracy (DP)"  # what test_accuracy measures, as printed


def default_run_dir(config: TrainConfig) -> Path:
    """runs/<dataset>-<model>-eps<ε>-<time>: the name a run gets when --out is not given."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    unit = "-user" if config.unit == "user" else ""
    return Path("runs") / (
        f"{config.dataset}-{config.model}{unit}-eps{config.target_epsilon:g}-{stamp}"
    )


def train_baseline(
    config: TrainConfig, data: LoadedDataset, console: Console | None = None
) -> float:
    """The same model, optimizer and schedule without privacy: the accuracy DP is compared to.

    A progress bar on ``console`` (none without one).
    """
    model, optimizer = fresh_model(config, data)
    generator = torch.Generator().manual_seed(public_seed(config.seed))
    loader = DataLoader(data.train, batch_size=config.batch_size, shuffle=True, generator=generator)
    criterion = nn.CrossEntropyLoss()
    epochs = max(1, math.ceil(config.epochs))
    with baseline_progress(console or Console(quiet=True)) as progress:
        task = progress.add_task(
            "baseline without privacy", total=epochs * len(loader), loss=math.nan
        )
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                progress.update(task, advance=1, loss=float(loss.detach()))
    return accuracy(model, data.test)


def load_run_data(config: TrainConfig) -> LoadedDataset:
    """The run's data: a bundled dataset, or the user's own file (``--data FILE --label COL``)."""
    if config.data is None:
        return load_dataset(config.dataset, data_dir=config.data_dir)
    from dpfy.data.user_file import load_user_file

    return load_user_file(
        config.data, config.label or "", config.feature_bounds, test_path=config.test_data
    )


def _user_split(config: TrainConfig, data: LoadedDataset) -> UserSplit | None:
    """At user level, the training split dealt to ``config.users`` skewed simulated users."""
    if config.unit != "user":
        return None
    return split_users(data.train.tensors[1], config.users, seed=public_seed(config.seed))


def run_training(
    config: TrainConfig, console: Console | None = None, *, resume: Path | None = None
) -> TrainResult:
    """Train, evaluate, write the run directory and the privacy report; return the figures.

    ``resume=RUN_DIR`` continues that interrupted run from its checkpoint (``config`` must be the
    run's own, from its ``config.json``), with fresh noise; a checkpoint is resumed once — a
    second continuation would be a second release of its steps — and a second resume of it is
    refused (:mod:`dpfy.jobs.checkpoint`), the continuation's own checkpoints resuming in turn.
    Ctrl-C raises :class:`~dpfy.jobs.outcome.Interrupted`
    once the checkpoint and the report of what was spent are written. Under ``torchrun
    --nproc-per-node N -m dpfy train …`` every rank trains its shard of one private run
    (:mod:`dpfy.train.distributed`); rank 0 alone evaluates the result into the run directory.
    """
    with launched_process_group():
        return _run_training(config, console, resume)


def _run_training(config: TrainConfig, console: Console | None, resume: Path | None) -> TrainResult:
    """One process's part of :func:`run_training`: claim the run directory, then train into it."""
    replicas = current_replicas()
    console = (console or Console()) if replicas.is_writer else Console(quiet=True)
    check_config(config)
    if replicas.world_size > 1 and config.unit == "user":
        raise ValueError("--unit user trains in one process; launch it without torchrun")
    if resume is not None:
        previous = replicas.on_writer(lambda: claim_for_resume(resume))
        return _train_into(resume, config, console, replicas, resuming=True, previous=previous)
    run_dir = replicas.on_writer(lambda: claim_run_dir(config.out, default_run_dir(config)))
    try:
        return _train_into(run_dir, config, console, replicas, resuming=False)
    finally:
        if replicas.is_writer:
            release_run_dir(run_dir)


def _make_run(config: TrainConfig, data: LoadedDataset) -> tuple[PrivateTraining, UserSplit | None]:
    """The model and optimizer made private with the run's settings (σ calibrated for its ε)."""
    split = _user_split(config, data)
    model, optimizer = fresh_model(config, data)
    private = make_private(
        model,
        optimizer,
        data.train,
        batch_size=config.batch_size,
        epochs=config.epochs,
        target_epsilon=config.target_epsilon,
        delta=config.resolved_delta(len(data.train) if split is None else split.num_users),
        max_grad_norm=config.max_grad_norm,
        engine=config.engine,
        seed=config.seed,
        user_ids=None if split is None else split.user_ids,
        max_examples_per_user=None if split is None else config.max_examples_per_user,
        algorithm=config.algorithm,
        sampler=config.sampler,
        max_batch_size=config.max_batch_size,
        bands=config.bands,
        buffers=config.buffers,
        criterion=nn.CrossEntropyLoss(),  # the loop calls private.criterion: the loss is probed
    )
    return private, split


def _train_into(
    run_dir: Path,
    config: TrainConfig,
    console: Console,
    replicas: SingleProcess | ProcessGroupReplicas,
    *,
    resuming: bool,
    previous: dict[str, Any] | None = None,
) -> TrainResult:
    """Load, train, evaluate and (on the writer) fill the claimed ``run_dir``.

    A resume that fails before its first step (its data, its checkpoint) puts back the status it
    found (``previous``): the run stays interrupted, never "running" in a process that ended.
    """
    from dpfy.jobs import outcome

    started = time.perf_counter()
    try:
        data = load_run_data(config)
        private, split = _make_run(config, data)
        job = load_checkpoint(private, run_dir) if resuming else JobState()
    except BaseException:
        if resuming and replicas.is_writer:
            restore_status(run_dir, previous)
        raise
    resumed_at = private.ledger.steps if resuming else None
    console.print(banner(config, data, private), soft_wrap=True)
    if resuming:
        console.print(f"resuming at step {resumed_at} of {private.plan.steps}", soft_wrap=True)
    if replicas.is_writer:
        outcome.started(run_dir, config, private)
    try:
        return _train_started(run_dir, config, console, replicas, data, private, split, job,
                              resumed_at, started)  # fmt: skip
    except outcome.Interrupted:
        raise
    except Exception as err:
        # A failing step or a full disk: the run is marked failed (never left "running"), what
        # it wrote is kept, and an OS error at write time is one line naming the file.
        if replicas.is_writer:
            outcome.failed(run_dir, err, private)
        if isinstance(err, OSError):
            raise write_failed(Path(err.filename or run_dir), err) from None
        raise


def _train_started(
    run_dir: Path,
    config: TrainConfig,
    console: Console,
    replicas: SingleProcess | ProcessGroupReplicas,
    data: LoadedDataset,
    private: PrivateTraining,
    split: UserSplit | None,
    job: JobState,
    resumed_at: int | None,
    started: float,
) -> TrainResult:
    """Train the started run, evaluate, and (on the writer) write how it ended."""
    from dpfy.jobs import outcome
    from dpfy.report.clip_norms import record_clip_norms

    eval_every = max(1, private.plan.steps // 20)  # also the checkpoint period
    with record_clip_norms(private) as norms, deferred_interrupts(replicas.world_size == 1) as stop:

        def so_far() -> JobState:
            spent = job.seconds + time.perf_counter() - started
            return JobState(job.history, outcome.merged(job.norms, norms), spent)

        try:
            history = train_private(
                private, data, console, eval_every, history=job.history,
                checkpoint=lambda: save_checkpoint(private, run_dir, so_far()), stop=stop,
            )  # fmt: skip
        except TrainingStopped as stopped:
            raise outcome.interrupted(
                private, run_dir, config, data, split, so_far(), stopped
            ) from None
    replicas.verify_ledger(private.ledger)
    test_accuracy = accuracy(private.model, data.test)
    result = TrainResult(
        run_dir, test_accuracy, None, private.epsilon(), private.plan.delta, 0.0, history,
        replicas.rank, steps=private.ledger.steps, resumed_at=resumed_at,
        algorithm=algorithm_label(private.plan),
    )  # fmt: skip
    if not replicas.is_writer:  # rank 0 writes the run directory; the others are done
        result.seconds = job.seconds + time.perf_counter() - started
        return result
    result.baseline_accuracy = train_baseline(config, data, console) if config.baseline else None
    result.seconds = job.seconds + time.perf_counter() - started
    state = JobState(history, outcome.merged(job.norms, norms), result.seconds)
    result.pitfalls = outcome.finished(
        private, run_dir, config, data, split, state, test_accuracy, result.baseline_accuracy
    )
    return result
