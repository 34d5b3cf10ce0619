"""Prediction-level DP (PATE-style GNMax): how many test queries a budget answers, how accurately.

For each dataset the teachers are trained once — ``dpfy train --access prediction``'s defaults:
one ``mlp`` teacher per ~50 training records (10–250 teachers), 20 epochs of Adam at lr 0.01,
batch 128, GNMax σ = 0.2 · teachers, all fixed a priori — on disjoint partitions of the *whole*
training split (digits 1437 records, Fashion-MNIST 60000). Then, for each ε, a fresh query
ledger of budget (ε, δ) serves the test split in its order (digits 360 queries, Fashion-MNIST
the first of its 10000) until the budget refuses the next query. Accounting is data-independent
(PLD over k Gaussian events of noise multiplier σ/√2), so the number answered depends on σ and
ε only; accuracy is over the answered queries. ``plurality_accuracy`` is the teachers'
noise-free vote on the whole test split, for reference (it is not private).

    .venv/bin/python benchmarks/_prediction_level.py            # digits and fashion-mnist
    .venv/bin/python benchmarks/_prediction_level.py --datasets digits

``benchmarks/access_models.py`` imports :func:`run`. Results go to
benchmarks/results/prediction_level.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from dpfy.access.prediction import PrivateEnsemble, noise_source
from dpfy.access.prediction_aggregator import GNMax, vote_histogram
from dpfy.access.prediction_ledger import QueryLedger
from dpfy.access.prediction_teachers import teacher_votes
from dpfy.data.datasets import load_dataset
from dpfy.jobs.config import TrainConfig
from dpfy.jobs.prediction_job import default_noise_multiplier, default_teachers
from dpfy.train.models import build_model

RESULTS = Path(__file__).parent / "results"
EPSILONS = [1.0, 2.0, 4.0, 8.0]
DATASETS = ["digits", "fashion-mnist"]


def _fit(dataset: str, seed: int) -> tuple[PrivateEnsemble, Any, float, float]:
    """The dataset's ensemble at the job's defaults, its data, δ and the training seconds."""
    config = TrainConfig(dataset=dataset)
    data = load_dataset(dataset)
    teachers = default_teachers(len(data.train))
    delta = config.resolved_delta(len(data.train))
    started = time.perf_counter()
    ensemble = PrivateEnsemble.fit(
        data.train,
        lambda: build_model(config.model, data.input_shape, data.num_classes),
        teachers=teachers,
        aggregator=GNMax(default_noise_multiplier(teachers)),
        epsilon=max(EPSILONS),
        delta=delta,
        num_classes=data.num_classes,
        epochs=round(config.epochs),
        batch_size=config.batch_size,
        lr=config.lr,
        seed=seed,
    )
    return ensemble, data, delta, time.perf_counter() - started


def _served(ensemble: PrivateEnsemble, epsilon: float, delta: float, seed: int) -> PrivateEnsemble:
    """The same teachers behind a fresh ledger of budget (ε, δ)."""
    ledger = QueryLedger(epsilon, delta, ensemble.aggregator, binding=ensemble.fingerprint())
    return PrivateEnsemble(
        ensemble.teachers,
        ensemble.aggregator,
        ledger,
        num_classes=ensemble.num_classes,
        input_shape=ensemble.input_shape,
        partition_seed=ensemble.partition_seed,
        noise=noise_source(seed),
    )


def run(dataset: str, epsilons: list[float], seed: int) -> list[dict]:
    """One row per ε: teachers, σ, queries answered and their accuracy, seconds."""
    ensemble, data, delta, train_seconds = _fit(dataset, seed)
    queries, truth = data.test.tensors
    votes = vote_histogram(teacher_votes(ensemble.teachers, queries), ensemble.num_classes)
    plurality = float((votes.argmax(dim=1) == truth).double().mean())
    rows = []
    for epsilon in epsilons:
        started = time.perf_counter()
        served = _served(ensemble, epsilon, delta, seed)
        count = min(len(queries), served.ledger.capacity())
        labels = served.answer(queries[:count]) if count else torch.empty(0, dtype=torch.long)
        hits = (labels == truth[:count]).double()
        rows.append(
            {
                "dataset": dataset,
                "epsilon": epsilon,
                "delta": delta,
                "teachers": len(ensemble.teachers),
                "sigma": ensemble.aggregator.noise_multiplier,
                "queries_answered": count,
                "queries_offered": len(queries),
                "accuracy": float(hits.mean()) if count else None,
                "epsilon_spent": served.epsilon(),
                "plurality_accuracy": plurality,
                "train_seconds": train_seconds,
                "seconds": train_seconds + time.perf_counter() - started,
                "train_size": len(data.train),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the datasets, print one line per row, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--datasets", nargs="+", default=DATASETS, choices=DATASETS)
    parser.add_argument("--epsilons", nargs="+", type=float, default=EPSILONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (small models)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dataset in args.datasets:
        for row in run(dataset, args.epsilons, args.seed):
            rows.append(row)
            accuracy = "—" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
            print(
                f"{dataset:14s} ε={row['epsilon']:g}: {row['teachers']} teachers, "
                f"σ={row['sigma']:g}, {row['queries_answered']}/{row['queries_offered']} "
                "answered, accuracy "
                f"{accuracy} (plurality {row['plurality_accuracy']:.4f}), {row['seconds']:.1f} s"
            )
    RESULTS.mkdir(exist_ok=True)
    document = {
        "benchmark": "prediction-level DP (GNMax, data-independent accounting)",
        "command": "python benchmarks/_prediction_level.py",
        "seed": args.seed,
        "threads": args.threads,
        "rows": rows,
    }
    target = RESULTS / "prediction_level.json"
    target.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
