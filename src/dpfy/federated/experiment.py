"""``dpfy federated``: DP-FedAvg on a bundled dataset split into skewed simulated users.

:func:`run_federated` loads the dataset, deals its training split to ``users`` simulated users
(:func:`dpfy.data.users.split_users`: Dirichlet label skew and log-normal sizes), calibrates σ for
the user-level target ε over the planned rounds, trains with :class:`~.fedavg.DPFedAvg` under
the in-process simulation runner, evaluates on the test split, and writes the run directory —
``report.md`` (unit of privacy: user), ``report.json``, ``facts.json``, ``history.json``,
``config.json``, ``model.pt`` and the plots.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from dpfy.data.datasets import LoadedDataset, load_dataset
from dpfy.data.users import UserSplit, split_users
from dpfy.federated.config import FederatedConfig
from dpfy.federated.fedavg import DPFedAvg, algorithm_of, federated_plan
from dpfy.federated.simulation import simulate
from dpfy.jobs.config import public_seed
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.models import build_model

__all__ = ["FederatedConfig", "FederatedResult", "federated_command", "run_federated"]


@dataclass
class FederatedResult:
    """What the run produced."""

    run_dir: Path
    test_accuracy: float
    epsilon: float
    delta: float
    noise_multiplier: float
    rounds: int
    seconds: float
    split: str
    history: list[dict[str, Any]] = field(default_factory=list)


def default_run_dir(config: FederatedConfig) -> Path:
    """runs/federated-<dataset>-<users>u-eps<ε>-<time>: the name when --out is not given."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"federated-{config.dataset}-{config.users}u-eps{config.target_epsilon:g}-{stamp}"
    return Path("runs") / name


def run_federated(config: FederatedConfig, console: Console | None = None) -> FederatedResult:
    """Split, calibrate, train with DP-FedAvg, evaluate, and write the run directory.

    The directory is claimed first (new or empty, never shared:
    :func:`dpfy.jobs.run_dir.claim_run_dir`)
    and released again if the run fails before writing into it.
    """
    from dpfy.jobs.run_dir import claim_run_dir, release_run_dir

    console = console or Console()
    delta = config.resolved_delta()
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    run_dir = claim_run_dir(config.out, default_run_dir(config))
    try:
        return _federate_into(run_dir, config, delta, console)
    finally:
        release_run_dir(run_dir)


def _federate_into(
    run_dir: Path, config: FederatedConfig, delta: float, console: Console
) -> FederatedResult:
    """The run itself, writing into the claimed ``run_dir``."""
    from dpfy.jobs.train import accuracy
    from dpfy.report.render import write_report

    started = time.perf_counter()
    data = load_dataset(config.dataset, data_dir=config.data_dir)
    labels = data.train.tensors[1]
    split = split_users(labels, config.users, alpha=config.alpha, seed=public_seed(config.seed))
    plan = federated_plan(
        config.users,
        config.clients_per_round,
        config.rounds,
        delta=delta,
        clip_norm=config.clip_norm,
        target_epsilon=config.target_epsilon,
        accountant=config.accountant,
        algorithm=config.algorithm_name,
        examples=split.num_examples,
        seeded=config.seed is not None,
    )
    sigma = plan.noise_multiplier
    ledger = PrivacyLedger(
        delta, accountant=config.accountant, target_epsilon=config.target_epsilon
    )
    torch.manual_seed(public_seed(config.seed))
    model = build_model(config.model, data.input_shape, data.num_classes)
    algorithm = config.fedavg(sigma)
    trainer = DPFedAvg(
        model,
        split.datasets(data.train),
        algorithm,
        ledger,
        rounds=config.rounds,
        seed=config.seed,
    )
    console.print(
        f"[bold]dpfy federated[/] {algorithm.algorithm} on {config.dataset}: {split.describe()}"
        f"\nuser-level ε = {config.target_epsilon:g}, δ = {delta:g} · σ = {sigma:.3f}, "
        f"q = {trainer.sampling_rate:.4f} ({config.clients_per_round} of {config.users} users "
        f"per round), {config.rounds} rounds"
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny local batches: extra intra-op threads only contend
    try:
        outcome = simulate(
            trainer, config.rounds, evaluate=lambda m: accuracy(m, data.test), console=console
        )
    finally:
        torch.set_num_threads(threads)
    if outcome.stopped:
        console.print(f"[yellow]stopped early:[/] {outcome.stopped}")
    test_accuracy = accuracy(model, data.test)
    seconds = time.perf_counter() - started
    torch.save(model.state_dict(), run_dir / "model.pt")
    (run_dir / "history.json").write_text(json.dumps(outcome.history, indent=2))
    (run_dir / "config.json").write_text(json.dumps(asdict(config), indent=2, default=str))
    facts = federated_facts(config, data, split, trainer, plan, test_accuracy, outcome.update_norms)
    write_report(facts, run_dir, history=outcome.history)
    return FederatedResult(
        run_dir,
        test_accuracy,
        ledger.epsilon(),
        delta,
        sigma,
        ledger.steps,
        seconds,
        split.describe(),
        outcome.history,
    )


def federated_facts(
    config: FederatedConfig,
    data: LoadedDataset,
    split: UserSplit,
    trainer: DPFedAvg,
    plan: PrivacyPlan,
    test_accuracy: float,
    norms: list[float],
) -> Any:
    """The run's facts for the report card: user-level unit, N and B counting users."""
    from dpfy.report.facts import (
        DatasetFacts,
        GradNormStats,
        ResultFacts,
        RunFacts,
        TrainingFacts,
        accounting_facts,
        model_facts,
        preprocessing_steps,
        software_versions,
    )

    algorithm = trainer.config
    ledger = trainer.ledger
    local = (
        "the full local data"
        if algorithm.local_batch_size is None
        else f"B_m = {algorithm.local_batch_size}"
    )
    optimizer = (
        f"{algorithm.algorithm}: server {algorithm.server_optimizer} (η_s = "
        f"{algorithm.server_lr:g}); clients run K = {algorithm.local_steps} SGD step(s), "
        f"η_c = {algorithm.client_lr:g}, {local}"
    )
    return RunFacts(
        dataset=DatasetFacts(
            data.name,
            split.num_examples,
            f"{data.source}; {split.describe()}",
            preprocessing_steps(data.preprocessing),
        ),
        model=model_facts(trainer.model, config.model),
        privacy=plan,
        training=TrainingFacts(
            optimizer=optimizer,
            learning_rate=algorithm.server_lr,
            steps_taken=ledger.steps,
            epochs=ledger.steps * trainer.sampling_rate,
            released="final-model",
            unit="user",
        ),
        accounting=accounting_facts(ledger),
        software=software_versions(),
        results=ResultFacts(accuracy=test_accuracy, evaluated_on=f"{data.name} test split"),
        grad_norms=GradNormStats.from_norms(norms, config.clip_norm) if norms else None,
    )


def federated_command(console: Console | None = None, **options: Any) -> FederatedResult:
    """What ``dpfy federated`` runs: build the config, train, print a short summary.

    Plain lines, never a table, so that paths are never cut or wrapped when piped; the whole
    report card is in the run directory's ``report.md``.
    """
    console = console or Console(soft_wrap=True)
    config = FederatedConfig(**options)
    result = run_federated(config, console)
    label = algorithm_of(config.local_steps, config.local_batch_size, config.client_lr)
    for line in (
        f"run directory: {result.run_dir}",
        f"report: {result.run_dir / 'report.md'}",
        f"test accuracy ({label}): {result.test_accuracy:.4f}",
        f"ε spent: {result.epsilon:.4f} at δ = {result.delta:g} (user-level)",
        f"rounds: {result.rounds}, σ = {result.noise_multiplier:.4f}",
        f"time: {result.seconds:.1f} s",
    ):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    return result
