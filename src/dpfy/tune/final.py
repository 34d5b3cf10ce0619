"""Train one configuration at the target ε and put the tuning cost in the same ledger.

The final run goes through the library's ordinary training path — ``make_private`` (σ calibrated
for the target ε; the budget guard stops training there), the trainer's loop with progress, the
facts collector and the report card. The tuning event is recorded *after* training, so the guard
spends the target on training and the report states training ε, tuning ε and their total
(guide §5.3.3 item 7, §5.4.2): the total is above the training target by exactly the tuning cost.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console

from dpfy.data.datasets import LoadedDataset
from dpfy.jobs.train import accuracy, fresh_model, train_private
from dpfy.report.facts import ResultFacts, collect_facts, record_clip_norms
from dpfy.report.render import write_report
from dpfy.train.builder import make_private
from dpfy.tune.trial import TrialConfig
from dpfy.tune.tuner import TuningOutcome


def train_final(
    config: TrialConfig,
    data: LoadedDataset,
    target_epsilon: float,
    delta: float,
    accountant: str,
    tuning: TuningOutcome | None,
    run_dir: Path | None,
    console: Console,
    *,
    dataset_name: str,
) -> dict[str, Any]:
    """Train ``config`` at ``target_epsilon``; record ``tuning`` in its ledger; maybe report."""
    model, optimizer = fresh_model(config, data)
    private = make_private(
        model,
        optimizer,
        data.train,
        batch_size=min(config.batch_size, len(data.train)),
        epochs=config.epochs,
        target_epsilon=target_epsilon,
        delta=delta,
        max_grad_norm=config.max_grad_norm,
        accountant=accountant,
        seed=config.seed,
    )
    quiet = console if run_dir is not None else Console(file=io.StringIO())
    eval_every = max(1, private.plan.steps // 5)
    with record_clip_norms(private) as norms:
        history = train_private(private, data, quiet, eval_every)
    test_accuracy = accuracy(private.model, data.test)
    if tuning is not None:
        tuning.record(private.ledger)
    epsilons = private.ledger.epsilon_by_label()
    result: dict[str, Any] = {
        "max_grad_norm": config.max_grad_norm,
        "lr": config.lr,
        "noise_multiplier": private.noise_multiplier,
        "steps": private.plan.steps,
        "test_accuracy": test_accuracy,
        "accountant": accountant,
        "epsilon": epsilons,
        "delta": delta,
    }
    if run_dir is not None:
        facts = collect_facts(
            private,
            dataset_name=dataset_name,
            model_name=config.model,
            dataset_source=data.source,
            preprocessing=data.preprocessing,
            tuning=None if tuning is None else tuning.facts(),
            results=ResultFacts(
                accuracy=test_accuracy, evaluated_on="held-out half of the test split"
            ),
            grad_norms=norms.stats(config.max_grad_norm),
            optimizer_name=config.optimizer,
            learning_rate=config.lr,
        )
        written = write_report(facts, run_dir, history=history)
        result["report"] = str(written["markdown"])
    private.detach()
    return result


__all__ = ["train_final"]
