"""Run DP-FedAvg rounds in-process, with a progress bar, periodic evaluation and the budget guard.

Experiments need the loop around :class:`~dpfy.federated.fedavg.DPFedAvg`: run the rounds, show
progress (users sampled, accuracy, user-level ε so far), keep a history for the report's training
plot, and stop cleanly — with every applied round accounted — when the budget would be exceeded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from dpfy._validate import check_count
from dpfy.federated.fedavg import DPFedAvg
from dpfy.train.ledger import BudgetExhausted

__all__ = ["SimulationResult", "simulate"]

Evaluate = Callable[[nn.Module], float]


@dataclass
class SimulationResult:
    """Rounds run, the evaluation history, and why the run stopped early (None if it did not)."""

    rounds: int
    history: list[dict[str, Any]] = field(default_factory=list)
    users_sampled: int = 0
    users_dropped: int = 0
    update_norms: list[float] = field(default_factory=list)  # unclipped, for diagnostics only
    stopped: str | None = None


def _progress(console: Console, enabled: bool) -> Progress:
    """Rounds done, users in the last round, accuracy and ε."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "users {task.fields[users]}  acc {task.fields[acc]:.3f}  ε {task.fields[eps]:.3f}"
        ),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
    )


def simulate(
    trainer: DPFedAvg,
    rounds: int,
    *,
    evaluate: Evaluate | None = None,
    eval_every: int | None = None,
    console: Console | None = None,
    progress: bool = True,
) -> SimulationResult:
    """Run up to ``rounds`` rounds; evaluate every ``eval_every`` rounds and after the last.

    A :class:`~dpfy.train.ledger.BudgetExhausted` refusal ends the run before that round changes the
    model; ``result.stopped`` says so. ε in the history is the ledger's user-level ε.
    """
    rounds = check_count("rounds", rounds, minimum=1)
    every = eval_every or max(1, rounds // 20)
    console = console or Console()
    result = SimulationResult(rounds=0)
    with _progress(console, progress) as bar:
        task = bar.add_task(trainer.config.algorithm, total=rounds, users=0, acc=math.nan, eps=0.0)
        for index in range(1, rounds + 1):
            try:
                outcome = trainer.round()
            except BudgetExhausted as err:
                result.stopped = str(err)
                break
            result.rounds = index
            result.users_sampled += len(outcome.sampled)
            result.users_dropped += len(outcome.dropped)
            result.update_norms.extend(outcome.update_norms)
            fields: dict[str, Any] = {"users": len(outcome.sampled)}
            if index % every == 0 or index == rounds:
                entry = _evaluate(trainer, index, evaluate)
                result.history.append(entry)
                fields.update(acc=entry.get("test_accuracy", math.nan), eps=entry["epsilon"])
            bar.update(task, advance=1, **fields)
    evaluated = bool(result.history) and result.history[-1]["step"] == result.rounds
    if result.stopped and result.rounds and not evaluated:  # the last applied round
        result.history.append(_evaluate(trainer, result.rounds, evaluate))
    return result


def _evaluate(trainer: DPFedAvg, index: int, evaluate: Evaluate | None) -> dict[str, Any]:
    """One history entry: round, epochs of users, ε, and accuracy when an evaluator is given."""
    entry: dict[str, Any] = {
        "step": index,
        "epoch": index * trainer.sampling_rate,
        "epsilon": trainer.ledger.epsilon(),
    }
    if evaluate is not None:
        entry["test_accuracy"] = evaluate(trainer.model)
    return entry
