"""``dpfy audit RUN_DIR --method black-box``: re-train once with canaries, attack the result.

The black-box one-run audit (:mod:`dpfy.audit.blackbox`) needs a model trained on canaries, so
the job re-trains the run's own configuration — its dataset, model, optimizer, learning rate,
batch size, clipping norm, and the σ and number of steps its plan records — with input-space
canaries each included by a coin flip, through the same make_private and the same loss as
``dpfy train``. Only that re-trained model is attacked; the run's own model, report and ledger
are untouched (the audit's ε̂ is appended to its facts like any other audit, its scope
``"re-trained-run"``: a re-run of the configuration, not the run's own trained model, and only
what its final model reveals). The cost — one extra training run — is timed on a few steps and
stated before it starts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dpfy.audit.blackbox import audit_from_losses, canary_losses, insert_canaries
from dpfy.audit.result import AuditResult
from dpfy.data.datasets import LoadedDataset
from dpfy.jobs.config import CONFIG_FILE, TrainConfig, public_seed, read_config
from dpfy.jobs.train import fresh_model, load_run_data
from dpfy.report.facts import RunFacts
from dpfy.train.builder import make_private
from dpfy.train.session import PrivateTraining

#: Steps timed (after one to warm up) for the cost stated up front.
_TIMED_STEPS = 3
_CRITERION = nn.CrossEntropyLoss()


@dataclass
class BlackBoxRun:
    """The re-run about to happen: its settings, data with canaries, and its estimated cost."""

    config: TrainConfig
    facts: RunFacts
    data: LoadedDataset
    canaries: int
    seed: int | None
    seconds: float

    @property
    def steps(self) -> int:
        """The re-run takes exactly the run's steps."""
        return self.facts.privacy.steps

    def lines(self) -> list[str]:
        """The cost as sentences for the terminal, before anything is trained."""
        plan = self.facts.privacy
        return [
            f"re-trains the run's configuration once ({self.config.dataset}, {self.config.model}"
            f", B = {plan.expected_batch_size}, σ = {plan.noise_multiplier:.4g}, C = "
            f"{plan.max_grad_norm:g}) with {self.canaries} input-space canaries, each included "
            f"by a coin flip: one extra training run of {self.steps} steps, about "
            f"{self.seconds:.1f} s",
            "only that re-trained model is attacked (its final model, black-box); the run's own "
            "model, accuracy and privacy ledger are unchanged",
        ]


def plan_blackbox(run_dir: Path, facts: RunFacts, canaries: int, seed: int | None) -> BlackBoxRun:
    """Read the run's settings, refuse what the audit cannot re-train, time a few steps."""
    plan = facts.privacy
    if plan.unit != "example" or plan.algorithm != "dp-sgd":
        raise ValueError(
            f"the black-box audit re-trains example-level DP-SGD runs, not {plan.algorithm} per "
            f"{plan.unit}; audit this run with --method one-run (white-box)"
        )
    if not (run_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{run_dir} holds no {CONFIG_FILE}, so its run cannot be re-trained")
    config = read_config(run_dir / CONFIG_FILE)
    data = load_run_data(config)  # a bundled dataset, or the user's own file (--data)
    insert_canaries(data.train, canaries, public_seed(seed))  # refuses bad sizes first
    run = BlackBoxRun(config, facts, data, canaries, seed, 0.0)
    run.seconds = _estimate_seconds(run)
    return run


def run_blackbox(
    run: BlackBoxRun, confidence: float, on_step: Callable[[], None] | None = None
) -> tuple[AuditResult, np.ndarray, np.ndarray]:
    """Train once with canaries, score them on the final model: ε̂ and the scores in / out."""
    start = time.perf_counter()
    coins = None if run.seed is None else run.seed + 1
    trainset, included, canaries = insert_canaries(
        run.data.train, run.canaries, public_seed(run.seed), coin_seed=coins
    )
    private = _private(run, trainset, run.facts.privacy.steps)
    _train(private, on_step)
    losses = canary_losses(private.model, canaries)
    claim = private.epsilon()
    result = audit_from_losses(
        losses,
        included,
        private.plan.delta,
        confidence,
        claim if math.isfinite(claim) else None,
        seed=public_seed(run.seed),
    )
    result = result.with_context(
        seconds=time.perf_counter() - start,
        scope="re-trained-run",
        notes=(
            *result.notes,
            f"{private.ledger.steps} steps of the run's configuration on {len(trainset)} "
            "records (the included canaries among them); the claim is that re-run's ε",
        ),
    )
    return result, -losses[included], -losses[~included]


def _private(run: BlackBoxRun, trainset: torch.utils.data.Dataset, steps: int) -> PrivateTraining:
    """The run's model, optimizer and private step (its σ, C, B, δ) on ``trainset``."""
    model, optimizer = fresh_model(run.config, run.data)
    plan = run.facts.privacy
    return make_private(
        model,
        optimizer,
        trainset,
        batch_size=plan.expected_batch_size,
        steps=steps,
        noise_multiplier=plan.noise_multiplier,
        delta=plan.delta,
        max_grad_norm=plan.max_grad_norm,
        engine=run.config.engine,
        seed=run.seed,
        criterion=_CRITERION,
    )


def _train(private: PrivateTraining, on_step: Callable[[], None] | None) -> None:
    """The train job's step (mean cross-entropy, the private optimizer) over every pass."""
    for _ in range(getattr(private.loader, "epochs", None) or 1):
        for x, y in private.loader:
            private.optimizer.zero_grad()
            private.criterion(private.model(x), y).backward()
            private.optimizer.step()
            if on_step is not None:
                on_step()


def _estimate_seconds(run: BlackBoxRun) -> float:
    """Time a few steps on a scratch copy (one to warm up), scaled to the run's steps."""
    trainset, _, _ = insert_canaries(run.data.train, run.canaries, 0, coin_seed=0)
    scratch = _private(run, trainset, 1 + _TIMED_STEPS)
    timed: list[float] = []
    _train(scratch, lambda: timed.append(time.perf_counter()))
    if len(timed) < 2:
        return 0.0
    return (timed[-1] - timed[0]) / (len(timed) - 1) * run.steps


__all__ = ["BlackBoxRun", "plan_blackbox", "run_blackbox"]
