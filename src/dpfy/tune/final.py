"""Train one configuration and put the tuning cost in the same ledger, within the total budget.

The final run goes through the library's ordinary training path — ``make_private`` (σ calibrated
for the training part of the budget; the budget guard stops training there), the trainer's loop
with progress, the facts collector and the report card. The trials ran before this run; their one
tuning event joins the ledger when training ends, so the guard watches the training part and the
report states training ε, tuning ε and their total (guide §5.3.3 item 7, §5.4.2). The training
part was calibrated so that the total stays within the whole budget (:mod:`dpfy.tune.budget`);
that total is checked with the σ ``make_private`` chose before the first step, and again from the
ledger, the report's own source, at the end.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from torch import nn

from dpfy.data.datasets import LoadedDataset
from dpfy.jobs.train import accuracy, fresh_model, train_private
from dpfy.plan.accounting.events import DpEvent, dpsgd_event
from dpfy.report.facts import ResultFacts, collect_facts, record_clip_norms
from dpfy.report.render import write_report
from dpfy.report.run_parts import PublicInput
from dpfy.train.builder import make_private
from dpfy.tune.budget import composed_total
from dpfy.tune.trial import TrialConfig
from dpfy.tune.tuner import TuningOutcome


def _check_total(spent: float, budget: float, when: str) -> None:
    """The total ε the report will state may never exceed the budget the user gave."""
    if spent > budget:
        raise RuntimeError(
            f"{when}, the total ε {spent:.6g} exceeds the budget {budget:.6g}; the run is "
            "refused rather than reported over budget — please report this"
        )


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
    total_budget: float | None = None,
    public_inputs: tuple[PublicInput, ...] = (),
    grid_edges: tuple[str, ...] = (),
    other_releases: Mapping[str, DpEvent] | None = None,
) -> dict[str, Any]:
    """Train ``config`` at ``target_epsilon``; record ``tuning`` in its ledger; maybe report.

    ``total_budget`` (training and tuning together) is checked before the first step and after
    the tuning event is recorded. ``other_releases`` are further models trained on the same
    private data (label → their ledger's event, e.g. the untuned default run): each joins this
    ledger under its label after that check, so the report's total and the returned ``epsilon``
    compose them with training and tuning — beyond the budget, and saying so; the returned
    ``budgeted_epsilon`` is training and tuning composed, the part the budget covers.
    """
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
        criterion=nn.CrossEntropyLoss(),  # the loop calls private.criterion: the loss is probed
    )
    tuning_event = tuning.event if tuning is not None and tuning.method.private else None
    if total_budget is not None:
        plan = private.plan
        steps = dpsgd_event(plan.sampling_rate, plan.noise_multiplier, plan.steps)
        try:
            _check_total(
                composed_total(steps, tuning_event, delta, accountant),
                total_budget,
                "before training",
            )
        except RuntimeError:
            private.detach()
            raise
    quiet = console if run_dir is not None else Console(file=io.StringIO())
    eval_every = max(1, private.plan.steps // 5)
    with record_clip_norms(private) as norms:
        history = train_private(private, data, quiet, eval_every)
    test_accuracy = accuracy(private.model, data.test)
    if tuning is not None:
        tuning.record(private.ledger)
    epsilons = private.ledger.epsilon_by_label()
    if total_budget is not None:
        _check_total(epsilons["total"], total_budget, "after training")
    budgeted = epsilons["total"]  # training and tuning: what the budget covers
    for label, event in (other_releases or {}).items():
        private.ledger.record_event(event, label=label)
    if other_releases:
        epsilons = private.ledger.epsilon_by_label()
    result: dict[str, Any] = {
        "max_grad_norm": config.max_grad_norm,
        "lr": config.lr,
        "noise_multiplier": private.noise_multiplier,
        "steps": private.plan.steps,
        "test_accuracy": test_accuracy,
        "accountant": accountant,
        "epsilon": epsilons,
        "budgeted_epsilon": budgeted,
        "delta": delta,
    }
    if run_dir is not None:
        facts = collect_facts(
            private,
            dataset_name=dataset_name,
            model_name=config.model,
            dataset_source=data.source,
            preprocessing=data.preprocessing,
            tuning=None if tuning is None else replace(tuning.facts(), grid_edges=grid_edges),
            results=ResultFacts(
                accuracy=test_accuracy, evaluated_on="held-out half of the test split"
            ),
            grad_norms=norms.stats(config.max_grad_norm),
            optimizer_name=config.optimizer,
            learning_rate=config.lr,
            public_inputs=public_inputs,
        )
        written = write_report(facts, run_dir, history=history)
        result["report"] = str(written["markdown"])
    result["events"] = private.ledger.events()  # everything it spent, for another ledger
    private.detach()
    return result


__all__ = ["train_final"]
