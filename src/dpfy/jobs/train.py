"""The main job: train a bundled model on a bundled real dataset with DP-SGD, end with a report.

:func:`run_training` is what ``dpfy train`` runs: load the dataset, build the model, make it
private (σ calibrated for the target ε), train with a progress bar showing loss, accuracy and ε,
evaluate, optionally train a non-private baseline for comparison, and write the run directory:
``report.md``, ``report.json``, ``facts.json``, ``history.json``, ``model.pt`` and the plots.
The run first claims that directory (:mod:`dpfy.jobs.run_dir`): it must be new or empty, so a run
never overwrites files it did not write and two runs never share one directory.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfy._validate import check_count, check_learning_rate, check_positive, check_seed
from dpfy.data.datasets import LoadedDataset, load_dataset
from dpfy.data.loader import rest_of_run
from dpfy.data.users import UserSplit, split_users
from dpfy.jobs.config import (
    ALGORITHM_NAMES,
    UNIT_NAMES,
    TrainConfig,
    check_epochs,
    public_seed,
)
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


def default_run_dir(config: TrainConfig) -> Path:
    """runs/<dataset>-<model>-eps<ε>-<time>: the name a run gets when --out is not given."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    unit = "-user" if config.unit == "user" else ""
    return Path("runs") / (
        f"{config.dataset}-{config.model}{unit}-eps{config.target_epsilon:g}-{stamp}"
    )


def check_config(config: TrainConfig) -> None:
    """Refuse bad settings before any data is loaded."""
    check_positive("target_epsilon", config.target_epsilon)
    check_epochs("epochs", config.epochs)
    check_count("batch_size", config.batch_size, minimum=1)
    check_positive("max_grad_norm", config.max_grad_norm)
    check_learning_rate("lr", config.lr)
    check_seed(config.seed)
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {config.optimizer!r}"
        )
    if config.unit not in UNIT_NAMES:
        raise ValueError(f"unit must be one of {', '.join(UNIT_NAMES)}; got {config.unit!r}")
    if config.unit == "user":
        check_count("users", config.users, minimum=1)
        if config.batch_size > config.users:
            raise ValueError(
                f"batch_size {config.batch_size} exceeds --users {config.users}: at user level "
                "batch_size is the expected number of users per step; lower it"
            )
    if config.max_examples_per_user is not None:
        check_count("max_examples_per_user", config.max_examples_per_user, minimum=1)
    if config.algorithm not in ALGORITHM_NAMES:
        raise ValueError(
            f"algorithm must be one of {', '.join(ALGORITHM_NAMES)}; got {config.algorithm!r}"
        )
    if config.algorithm == "dp-ftrl" and config.unit != "example":
        raise ValueError("--algorithm dp-ftrl needs --unit example")


def accuracy(model: nn.Module, data: TensorDataset, batch_size: int = 1024) -> float:
    """Top-1 accuracy of ``model`` on ``data`` (an empty split has none: refused, not 0/0)."""
    if len(data) == 0:
        raise ValueError(
            "cannot measure accuracy on an empty split (0 examples); give the dataset a test "
            "split with examples"
        )
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=batch_size):
            correct += int((model(x).argmax(dim=1) == y).sum())
    model.train()
    return correct / len(data)


def _progress(console: Console) -> Progress:
    """A rich progress bar with loss, accuracy and ε so far."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]:.3f}  acc {task.fields[acc]:.3f}  ε {task.fields[eps]:.3f}"
        ),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def train_private(
    private: PrivateTraining,
    data: LoadedDataset,
    console: Console,
    eval_every: int,
) -> list[dict[str, float]]:
    """The user's ordinary loop, plus progress and periodic evaluation; returns the history."""
    criterion = nn.CrossEntropyLoss()
    history: list[dict[str, float]] = []
    total = private.plan.steps
    running_loss, running_correct, running_seen = 0.0, 0, 0
    with _progress(console) as progress:
        task = progress.add_task("DP-SGD", total=total, loss=math.nan, acc=math.nan, eps=0.0)
        for step, (x, y) in enumerate(rest_of_run(private.loader), start=1):
            private.optimizer.zero_grad()
            output = private.model(x)
            loss = criterion(output, y)
            loss.backward()
            private.optimizer.step()
            if len(y):
                running_loss += float(loss.detach()) * len(y)
                running_correct += int((output.argmax(dim=1) == y).sum())
                running_seen += len(y)
            if step % eval_every == 0 or step == total:
                entry = {
                    "step": step,
                    "epoch": step * private.plan.expected_batch_size / private.plan.dataset_size,
                    "loss": running_loss / max(running_seen, 1),
                    "train_accuracy": running_correct / max(running_seen, 1),
                    "test_accuracy": accuracy(private.model, data.test),
                    "epsilon": private.epsilon(),
                }
                history.append(entry)
                running_loss, running_correct, running_seen = 0.0, 0, 0
                progress.update(
                    task, loss=entry["loss"], acc=entry["test_accuracy"], eps=entry["epsilon"]
                )
            progress.update(task, advance=1)
    return history


def train_baseline(config: TrainConfig, data: LoadedDataset) -> float:
    """The same model, optimizer and schedule without privacy: the accuracy DP is compared to."""
    model, optimizer = fresh_model(config, data)
    generator = torch.Generator().manual_seed(public_seed(config.seed))
    loader = DataLoader(data.train, batch_size=config.batch_size, shuffle=True, generator=generator)
    criterion = nn.CrossEntropyLoss()
    epochs = max(1, math.ceil(config.epochs))
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    return accuracy(model, data.test)


def _user_split(config: TrainConfig, data: LoadedDataset) -> UserSplit | None:
    """At user level, the training split dealt to ``config.users`` skewed simulated users."""
    if config.unit != "user":
        return None
    return split_users(data.train.tensors[1], config.users, seed=public_seed(config.seed))


def run_training(config: TrainConfig, console: Console | None = None) -> TrainResult:
    """Train, evaluate, write the run directory and the privacy report; return the figures.

    Under ``torchrun --nproc-per-node N -m dpfy train …`` every rank trains its shard of one
    private run (:mod:`dpfy.train.distributed`); rank 0 alone evaluates the result into the run
    directory.
    """
    with launched_process_group():
        return _run_training(config, console)


def _run_training(config: TrainConfig, console: Console | None = None) -> TrainResult:
    """One process's part of :func:`run_training`: claim the run directory, then train into it."""
    replicas = current_replicas()
    console = (console or Console()) if replicas.is_writer else Console(quiet=True)
    check_config(config)
    if replicas.world_size > 1 and config.unit == "user":
        raise ValueError("--unit user trains in one process; launch it without torchrun")
    run_dir = replicas.on_writer(lambda: claim_run_dir(config.out, default_run_dir(config)))
    try:
        return _train_into(run_dir, config, console, replicas)
    finally:
        if replicas.is_writer:
            release_run_dir(run_dir)


def _train_into(
    run_dir: Path,
    config: TrainConfig,
    console: Console,
    replicas: SingleProcess | ProcessGroupReplicas,
) -> TrainResult:
    """Load, train, evaluate and (on the writer) fill the claimed ``run_dir``."""
    from dpfy.report.facts import ResultFacts, collect_facts, record_clip_norms
    from dpfy.report.history import write_history
    from dpfy.report.render import write_report

    started = time.perf_counter()
    data = load_dataset(config.dataset, data_dir=config.data_dir)
    split = _user_split(config, data)
    delta = config.resolved_delta(len(data.train) if split is None else split.num_users)
    model, optimizer = fresh_model(config, data)
    private = make_private(
        model,
        optimizer,
        data.train,
        batch_size=config.batch_size,
        epochs=config.epochs,
        target_epsilon=config.target_epsilon,
        delta=delta,
        max_grad_norm=config.max_grad_norm,
        engine=config.engine,
        seed=config.seed,
        user_ids=None if split is None else split.user_ids,
        max_examples_per_user=None if split is None else config.max_examples_per_user,
        algorithm=config.algorithm,
    )
    console.print(
        f"[bold]dpfy train[/] {config.dataset} ({len(data.train)} examples) · {config.model} · "
        f"ε = {config.target_epsilon:g}, δ = {delta:g} · σ = {private.noise_multiplier:.3f}, "
        f"q = {private.plan.sampling_rate:.4f}, {private.plan.steps} steps · "
        f"engine {private.engine.kind}"
        + ("" if split is None else f" · user-level, {split.num_users} users")
    )
    eval_every = max(1, private.plan.steps // 20)
    with record_clip_norms(private) as norms:
        history = train_private(private, data, console, eval_every)
    test_accuracy = accuracy(private.model, data.test)
    replicas.verify_ledger(private.ledger)
    if not replicas.is_writer:  # rank 0 writes the run directory; the others are done
        seconds = time.perf_counter() - started
        return TrainResult(
            run_dir, test_accuracy, None, private.epsilon(), delta, seconds, history, replicas.rank
        )
    baseline = train_baseline(config, data) if config.baseline else None
    seconds = time.perf_counter() - started
    torch.save(private.model.state_dict(), run_dir / "model.pt")
    write_history(run_dir / "history.json", history)  # train metrics labelled not private
    (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2, default=str))
    facts = collect_facts(
        private,
        dataset_name=data.name,
        model_name=config.model,
        dataset_source=data.source if split is None else f"{data.source}; {split.describe()}",
        preprocessing=data.preprocessing,
        results=ResultFacts(accuracy=test_accuracy, baseline_accuracy=baseline),
        grad_norms=norms.stats(config.max_grad_norm),
        optimizer_name=config.optimizer,
        learning_rate=config.lr,
    )
    write_report(facts, run_dir, history=history)
    return TrainResult(run_dir, test_accuracy, baseline, private.epsilon(), delta, seconds, history)
