"""``dpfy train --access prediction``: serve a private ensemble and answer the test split's queries.

:func:`run_prediction_job` trains the teachers (plain torch, one per disjoint partition of the
training split) for the config's dataset and model, answers the test split as queries through
GNMax until the budget ``target_epsilon`` is spent, and writes into ``out_dir``: ``report.md`` and
``report.json`` (only answers are protected; the model is never released), ``answers.json`` (the
released labels), ``ledger.json`` (the sealed query ledger) and ``ensemble.pt`` (the teachers —
owner-only, for the server alone). :func:`run_prediction_training` is the registry's entry: it
claims a run directory first, as every ``dpfy train`` job does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from dpfy.access.prediction import PrivateEnsemble
from dpfy.access.prediction_aggregator import UNANSWERED, GNMax
from dpfy.access.prediction_ledger import QueryBudgetExhausted
from dpfy.data.datasets import load_dataset
from dpfy.jobs.config import TrainConfig, check_config
from dpfy.jobs.one_shot import run_one_shot
from dpfy.jobs.train import TrainResult
from dpfy.report.access_facts import AccessFacts
from dpfy.report.access_pitfalls import access_findings
from dpfy.report.pitfalls import Finding
from dpfy.report.prediction_card import PredictionRun, write_prediction_report
from dpfy.train.models import build_model

__all__ = [
    "PredictionResult",
    "default_noise_multiplier",
    "default_teachers",
    "run_prediction_job",
    "run_prediction_training",
]

#: Records per teacher the default aims at, and the range of teacher counts it keeps to.
RECORDS_PER_TEACHER, MIN_TEACHERS, MAX_TEACHERS = 50, 10, 250
#: σ as a share of the teachers: agreeing teachers' margin stays a few σ above the noise.
NOISE_PER_TEACHER = 0.2


def default_teachers(train_size: int) -> int:
    """About one teacher per 50 records, within [10, 250]: set by N alone, as every run states N."""
    return max(MIN_TEACHERS, min(MAX_TEACHERS, train_size // RECORDS_PER_TEACHER))


def default_noise_multiplier(teachers: int) -> float:
    """σ = 0.2 · teachers, fixed a priori (not tuned on the private data)."""
    return NOISE_PER_TEACHER * teachers


@dataclass(frozen=True)
class PredictionResult:
    """What the served ensemble did: queries answered, their accuracy, ε and the settings."""

    run_dir: Path
    teachers: int
    noise_multiplier: float
    epsilon: float
    delta: float
    queries_offered: int
    queries_answered: int
    answered_accuracy: float | None
    seconds: float
    pitfalls: tuple[Finding, ...] = ()


def _check(config: TrainConfig) -> None:
    """Settings that belong to DP-SGD do not apply to a served ensemble."""
    check_config(config)
    if (config.unit, config.algorithm) != ("example", "dp-sgd") or config.stages != 1:
        raise ValueError(
            "--access prediction trains non-private teachers and noises their votes: drop "
            "--unit, --algorithm and --stages (they apply to other access models)"
        )


def run_prediction_job(
    config: TrainConfig,
    out_dir: Path,
    *,
    teachers: int | None = None,
    noise_multiplier: float | None = None,
    query_limit: int | None = None,
    console: Console | None = None,
) -> PredictionResult:
    """Train the ensemble, answer the test split until the budget, write the report into out_dir.

    ``teachers`` and ``noise_multiplier`` default to :func:`default_teachers` and
    :func:`default_noise_multiplier`; ``query_limit`` offers only the first queries of the test
    split (fast runs).
    """
    _check(config)
    started = time.perf_counter()
    console = console or Console(quiet=True)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = load_dataset(config.dataset, data_dir=config.data_dir)
    delta = config.resolved_delta(len(data.train))
    count = teachers if teachers is not None else default_teachers(len(data.train))
    sigma = noise_multiplier if noise_multiplier is not None else default_noise_multiplier(count)
    console.print(
        f"prediction-level DP on {data.name}: {count} {config.model} teachers, GNMax σ = "
        f"{sigma:g}, budget ε = {config.target_epsilon:g} at δ = {delta:g}"
    )
    ensemble = PrivateEnsemble.fit(
        data.train,
        lambda: build_model(config.model, data.input_shape, data.num_classes),
        teachers=count,
        aggregator=GNMax(sigma),
        epsilon=config.target_epsilon,
        delta=delta,
        num_classes=data.num_classes,
        epochs=max(1, round(config.epochs)),
        batch_size=config.batch_size,
        lr=config.lr,
        seed=config.seed,
    )
    queries, truth = data.test.tensors
    if query_limit is not None:
        queries, truth = queries[:query_limit], truth[:query_limit]
    labels, refused = _serve(ensemble, queries)
    ensemble.save(out_dir / "ensemble.pt")
    _write_json(out_dir / "ledger.json", ensemble.ledger.state_dict())
    _write_json(out_dir / "answers.json", {"labels": labels.tolist()})
    answered = labels != UNANSWERED
    hits = (labels[answered] == truth[: len(labels)][answered]).double()
    accuracy = float(hits.mean()) if len(hits) else None
    access = AccessFacts(
        "prediction",
        ensemble.epsilon(),
        delta,
        "gnmax",
        f"{count} teachers on disjoint partitions; GNMax σ = {sigma:g}; {int(answered.sum())} "
        f"queries answered.",
        seeded=config.seed is not None,
    )
    run = PredictionRun(
        access,
        data.name,
        data.source,
        len(data.train),
        config.model,
        count,
        ensemble.aggregator.spec(),
        ensemble.ledger.accountant,
        config.target_epsilon,
        len(queries),
        ensemble.ledger.asked,
        ensemble.ledger.answered,
        ensemble.ledger.capacity(),
        accuracy,
        refused,
        ensemble.ledger.relation.value,
    )
    findings = access_findings(access)
    write_prediction_report(run, findings, out_dir)
    return PredictionResult(
        out_dir,
        count,
        sigma,
        ensemble.epsilon(),
        delta,
        len(queries),
        ensemble.ledger.answered,
        accuracy,
        time.perf_counter() - started,
        findings,
    )


def _serve(ensemble: PrivateEnsemble, queries: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """Answer as many queries as the budget allows; the first refused one's message, if any."""
    fit = min(len(queries), ensemble.ledger.remaining())
    labels = ensemble.answer(queries[:fit]) if fit else torch.empty(0, dtype=torch.long)
    if fit == len(queries):
        return labels, None
    try:
        ensemble.answer(queries[fit : fit + 1])
    except QueryBudgetExhausted as refusal:
        return labels, str(refusal)
    raise AssertionError("the ledger answered a query past its own capacity")


def _write_json(path: Path, document: object) -> None:
    """Write one JSON document."""
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def run_prediction_training(
    config: TrainConfig, console: Console | None = None, *, resume: Path | None = None
) -> TrainResult:
    """``dpfy train --access prediction``: claim a run directory, then run the job into it."""
    _check(config)
    no_resume = (
        "--access prediction trains its teachers in one go and has no checkpoint to resume; "
        "serve the saved ensemble.pt with PrivateEnsemble.load instead"
    )
    result = run_one_shot(
        config,
        resume,
        no_resume,
        lambda d: run_prediction_job(config, d, console=console or Console()),
    )
    return TrainResult(
        result.run_dir,
        result.answered_accuracy or 0.0,
        None,
        result.epsilon,
        result.delta,
        result.seconds,
        pitfalls=result.pitfalls,
        steps=result.queries_answered,
        algorithm=f"prediction-level DP, GNMax over {result.teachers} teachers",
        released=f"{result.queries_answered} of {result.queries_offered} queries answered",
        accuracy_of="accuracy of the answered queries",
    )
