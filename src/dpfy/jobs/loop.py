"""The training job's loop: the user's ordinary PyTorch loop, plus progress, periodic evaluation,
periodic checkpoints and a clean stop on Ctrl-C.

Ctrl-C never cuts a private step in half (its noise drawn, its model update not yet applied):
the first one asks the loop to stop after the step in hand, and the loop then raises
:class:`TrainingStopped` at a step boundary, where the run's state is whole and can be saved.
A second Ctrl-C stops at once, keeping only the last periodic checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfy.data.datasets import LoadedDataset
from dpfy.jobs.config import TrainConfig
from dpfy.jobs.progress_bars import step_progress
from dpfy.plan.correlated_events import describe_strategy
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.variants import variant_for
from dpfy.train.session import PrivateTraining


def algorithm_label(plan: PrivacyPlan) -> str:
    """The name of the algorithm that runs, as the progress bar and banner show it (its
    registered variant's label)."""
    return variant_for(plan.algorithm, plan.unit).label


def banner(config: TrainConfig, data: LoadedDataset, private: PrivateTraining) -> str:
    """The run's first line: what is trained, at which (ε, δ), and how the algorithm draws its
    batches — q for Poisson-sampled DP-SGD; passes and order for DP-FTRL, BandMF and BLT, which
    sample nothing."""
    plan = private.plan
    if plan.mechanism == "tree-aggregation":
        per_pass = getattr(private.loader, "steps_per_epoch", None) or plan.steps
        order = "fixed" if "fixed" in plan.sampler else "shuffled"
        how = (
            f"{algorithm_label(plan)}, tree aggregation (restart every {plan.restart_every} "
            f"steps): {math.ceil(plan.steps / per_pass)} epochs of ≤ {per_pass} batches in "
            f"{order} order, no sampling assumption, {plan.steps} steps"
        )
    elif plan.strategy is not None:  # matrix-factorisation noise over one repeated order
        per_pass = plan.dataset_size // plan.expected_batch_size
        how = (
            f"{describe_strategy(plan.mechanism, plan.strategy)} (matrix-factorisation noise): "
            f"{math.ceil(plan.steps / per_pass)} epochs of {per_pass} batches in one order "
            f"repeated every epoch, no sampling assumption, {plan.steps} steps"
        )
    else:
        how = f"{algorithm_label(plan)}: q = {plan.sampling_rate:.4f}, {plan.steps} steps"
    users = "" if plan.unit != "user" else f" · user-level, {plan.dataset_size} users"
    return (
        f"[bold]dpfy train[/] {config.dataset} ({len(data.train)} examples) · {config.model} · "
        f"ε = {config.target_epsilon:g}, δ = {plan.delta:g} · σ = {plan.noise_multiplier:.3f} · "
        f"{how} · engine {private.engine.kind}{users}"
    )


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


#: The signals that stop a run at a step boundary, as Ctrl-C does.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingStopped(Exception):
    """Ctrl-C stopped training; ``at_step_boundary`` says whether the state in memory is whole."""

    def __init__(self, at_step_boundary: bool) -> None:
        super().__init__("training was interrupted")
        self.at_step_boundary = at_step_boundary


@dataclass
class StopRequest:
    """Set by the first Ctrl-C; ``in_step`` is True while a private step is under way."""

    requested: bool = False
    in_step: bool = False


@contextlib.contextmanager
def deferred_interrupts(enabled: bool = True) -> Iterator[StopRequest]:
    """Turn the first Ctrl-C (or SIGTERM) into a stop request the loop honours between steps.

    Only the main thread can own SIGINT, and under torchrun every rank gets the signal at its
    own moment, so ranks could stop at different steps: there (``enabled=False``) Ctrl-C keeps
    its usual effect and the periodic checkpoints are what a resume continues from.
    """
    stop = StopRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def request_stop(signum: int, frame: Any) -> None:
        if stop.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        stop.requested = True

    # SIGTERM (what `kill`, a scheduler or a container stop sends) is a Ctrl-C: the run stops at
    # a step boundary with its checkpoint, its report and status "interrupted".
    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _progress(console: Console) -> Progress:
    """A rich progress bar with loss, accuracy and ε so far, and the time left."""
    return step_progress(
        console,
        "loss {task.fields[loss]:.3f}  acc {task.fields[acc]:.3f}  ε {task.fields[eps]:.3f}",
    )


def _passes(loader: Any) -> Iterable[int]:
    """The loader passes still to run: those left of ``loader.epochs`` for a loader that yields
    one epoch per pass (a resumed one continues its interrupted pass), else its one pass."""
    epochs = getattr(loader, "epochs", None)
    if epochs is None:
        return range(1)  # one pass over the loader is the whole run
    return range(getattr(loader, "epoch", 0), epochs)


def train_private(
    private: PrivateTraining,
    data: LoadedDataset,
    console: Console,
    eval_every: int,
    *,
    history: list[dict[str, float]] | None = None,
    checkpoint: Callable[[], None] | None = None,
    stop: StopRequest | None = None,
) -> list[dict[str, float]]:
    """The user's ordinary loop, plus progress and periodic evaluation; returns the history.

    It starts at the ledger's step count (a resumed run continues its steps and ``history``),
    calls ``checkpoint`` at every evaluation, before its figures are shown, and raises
    :class:`TrainingStopped` when ``stop`` is requested or Ctrl-C arrives. Checkpointing before
    showing means a figure computed from the model (test accuracy) only ever leaves the process
    at a step a resume continues after: a resume (which draws fresh noise) never trains again a
    step whose result was already seen, which would release it twice.
    """
    history = [] if history is None else history
    stop = stop or StopRequest()
    total, step = private.plan.steps, private.ledger.steps
    try:
        with _progress(console) as progress:
            task = progress.add_task(
                algorithm_label(private.plan), total=total, completed=step,
                loss=math.nan, acc=math.nan, eps=private.epsilon() if step else 0.0,
            )  # fmt: skip
            running = _Running()
            for _ in _passes(private.loader) if step < total else ():  # resumed when done
                for x, y in private.loader:
                    stop.in_step = True
                    running.add(*_step(private, x, y))
                    stop.in_step = False
                    step += 1
                    if step % eval_every == 0 or step == total:
                        entry = _evaluate(private, data, step, running)
                        history.append(entry)
                        if checkpoint is not None:  # before the figures are shown: see above
                            checkpoint()
                        progress.update(
                            task, loss=entry["loss"], acc=entry["test_accuracy"],
                            eps=entry["epsilon"],
                        )  # fmt: skip
                    progress.update(task, advance=1)
                    if stop.requested and step < total:
                        raise TrainingStopped(at_step_boundary=True)
    except KeyboardInterrupt:
        raise TrainingStopped(at_step_boundary=not stop.in_step) from None
    return history


def _step(private: PrivateTraining, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
    """One private step; returns the batch's summed loss, correct predictions and size."""
    private.optimizer.zero_grad()
    output = private.model(x)
    loss = private.criterion(output, y)  # probed: each example's loss must stand alone
    loss.backward()
    private.optimizer.step()
    if not len(y):
        return 0.0, 0, 0
    return float(loss.detach()) * len(y), int((output.argmax(dim=1) == y).sum()), len(y)


class _Running:
    """Train loss and accuracy over the batches since the last evaluation (private data)."""

    def __init__(self) -> None:
        self.loss, self.correct, self.seen = 0.0, 0, 0

    def add(self, loss: float, correct: int, seen: int) -> None:
        """Count one batch in."""
        self.loss, self.correct, self.seen = (
            self.loss + loss,
            self.correct + correct,
            self.seen + seen,
        )

    def take(self) -> tuple[float, float]:
        """Mean loss and accuracy so far, then start over."""
        seen = max(self.seen, 1)
        means = self.loss / seen, self.correct / seen
        self.loss, self.correct, self.seen = 0.0, 0, 0
        return means


def _evaluate(
    private: PrivateTraining, data: LoadedDataset, step: int, running: _Running
) -> dict[str, float]:
    """One history row: step, epoch, train loss/accuracy so far, test accuracy and ε."""
    loss, train_accuracy = running.take()
    return {
        "step": step,
        "epoch": step * private.plan.expected_batch_size / private.plan.dataset_size,
        "loss": loss,
        "train_accuracy": train_accuracy,
        "test_accuracy": accuracy(private.model, data.test),
        "epsilon": private.epsilon(),
    }
