"""``dpfy train --access label|input``: the same datasets and models, other access models (§3.2).

Label-only: every training label is randomised once (RR, or RR-with-prior in stages), then the
model trains without noise on the public features and those labels. Input-level: every training
record is randomised by a local randomiser (Laplace on features clipped into public bounds, RR on
its label, half the ε each), then the model trains without noise on the randomised records. Both
write a run directory: ``config.json``, ``model.pt``, ``report.md`` and ``report.json`` (the
access model, its ε and randomiser, accuracy and pitfalls), ``diagnostics.md`` and
``diagnostics.json`` (a ``--baseline`` accuracy: not for publication) and ``status.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from dpfy._safe_io import atomic_write
from dpfy.access.feature_bounds import bounds_for
from dpfy.access.input_dp import InputRandomiser
from dpfy.access.label_dp import fit_on_labels, train_label_private
from dpfy.data.datasets import load_dataset
from dpfy.jobs.config import TrainConfig, check_config, public_seed
from dpfy.jobs.loop import accuracy
from dpfy.jobs.one_shot import run_one_shot
from dpfy.jobs.train import TrainResult, fresh_model, train_baseline
from dpfy.report.access_card import AccessRun, write_access_report
from dpfy.report.access_facts import AccessFacts
from dpfy.report.access_pitfalls import access_findings

__all__ = ["run_input_training", "run_label_training"]

#: The share of a record's ε that input-level runs spend on its label (the rest on features).
LABEL_SHARE = 0.5


def _epochs(config: TrainConfig) -> int:
    """Whole passes over the data (the noisy data is fixed, so partial epochs buy nothing)."""
    return max(1, round(config.epochs))


def _run(
    config: TrainConfig,
    console: Console | None,
    resume: Path | None,
    body: Callable[[TrainConfig, Path, Console], TrainResult],
) -> TrainResult:
    """Check the config, then run ``body`` in a freshly claimed run directory."""
    check_config(config)
    no_resume = (
        f"--access {config.access} runs randomise once and train in one go; they have no "
        "checkpoint to resume: start the run again"
    )
    return run_one_shot(config, resume, no_resume, lambda d: body(config, d, console or Console()))


def _finish(
    run: AccessRun, model: torch.nn.Module, run_dir: Path, started: float, algorithm: str,
    steps: int, released: str,
) -> TrainResult:  # fmt: skip
    """Write the model and the report; the result the CLI prints."""
    atomic_write(run_dir / "model.pt", lambda path: torch.save(model.state_dict(), path))
    findings = access_findings(run.access)
    write_access_report(run, findings, run_dir)
    assert run.access.epsilon is not None
    return TrainResult(
        run_dir, float(run.accuracy or 0.0), run.baseline_accuracy, run.access.epsilon,
        run.access.delta, time.perf_counter() - started, pitfalls=findings, steps=steps,
        algorithm=algorithm, released=released,
    )  # fmt: skip


def _label_body(config: TrainConfig, run_dir: Path, console: Console) -> TrainResult:
    """Randomise the labels, train on them, evaluate, report."""
    started = time.perf_counter()
    data = load_dataset(config.dataset, data_dir=config.data_dir)
    features, labels = data.train.tensors
    stages = f" in {config.stages} stages" if config.stages > 1 else ""
    console.print(
        f"label-only DP on {data.name} ({len(labels)} labels, {config.label_mechanism}{stages}) "
        f"at ε = {config.target_epsilon:g} per label; model {config.model}"
    )
    result = train_label_private(
        lambda: fresh_model(config, data), features, labels, data.num_classes,
        config.target_epsilon, mechanism=config.label_mechanism, stages=config.stages,
        epochs=_epochs(config), batch_size=config.batch_size, seed=config.seed,
    )  # fmt: skip
    sizes = ", ".join(str(s) for s in result.stage_sizes)
    detail = (
        f"Randomiser: {config.label_mechanism} at ε = {config.target_epsilon:g}"
        + (f" in {config.stages} disjoint stages of {sizes} labels, each stage's prior from "
           "the model trained on the earlier stages' randomised labels." if stages else ".")
        + " The model trains with the forward-corrected loss (the randomiser's known channel, "
        "which depends only on ε and the public prior: post-processing)."
    )  # fmt: skip
    access = AccessFacts(
        "label", result.ledger.epsilon, 0.0, config.label_mechanism, detail,
        features_public=config.features_public, seeded=config.seed is not None,
    )  # fmt: skip
    run = AccessRun(
        access, data.name, data.source, len(labels), config.model,
        accuracy(result.model, data.test),
        train_baseline(config, data) if config.baseline else None,
        result.ledger.state_dict(),
    )  # fmt: skip
    algorithm = f"label-only DP, {config.label_mechanism}{stages}"
    released = f"{len(labels)} labels randomised once each"
    return _finish(run, result.model, run_dir, started, algorithm, config.stages, released)


def _input_body(config: TrainConfig, run_dir: Path, console: Console) -> TrainResult:
    """Randomise every record within public bounds, train on them, evaluate, report."""
    started = time.perf_counter()
    shape_probe = bounds_for(config.dataset, 1)  # refuses a dataset without public bounds
    data = load_dataset(config.dataset, data_dir=config.data_dir, standardize=shape_probe[1])
    features, labels = data.train.tensors
    bounds, _ = bounds_for(config.dataset, int(np.prod(data.input_shape)))
    randomiser = InputRandomiser(bounds, config.target_epsilon, label_share=LABEL_SHARE)
    console.print(
        f"input-level DP on {data.name} ({len(labels)} records) at ε = "
        f"{config.target_epsilon:g} per record: Laplace b = {randomiser.noise_scale:.4g} per "
        f"feature, labels by RR at ε = {randomiser.label_epsilon:g}; model {config.model}"
    )
    released = randomiser(
        features.numpy(), labels.numpy(), data.num_classes, np.random.default_rng(config.seed)
    )
    noisy_x = torch.from_numpy(released.features.astype(np.float32))
    noisy_y = torch.from_numpy(np.asarray(released.labels, dtype=np.int64))
    model = fit_on_labels(
        lambda: fresh_model(config, data), noisy_x, noisy_y, epochs=_epochs(config),
        batch_size=config.batch_size, seed=public_seed(config.seed),
    )  # fmt: skip
    detail = (
        f"Each record: features clipped into the public bounds and given Laplace noise of scale "
        f"Δ₁/ε_x = {randomiser.sensitivity:g}/{randomiser.feature_epsilon:g} = "
        f"{randomiser.noise_scale:.4g} per feature; label by {data.num_classes}-ary randomised "
        f"response at ε_y = {randomiser.label_epsilon:g}; ε = ε_x + ε_y."
    )
    access = AccessFacts(
        "input", config.target_epsilon, 0.0, "laplace", detail, bounds=bounds.source,
        seeded=config.seed is not None,
    )  # fmt: skip
    run = AccessRun(
        access, data.name, data.source, len(labels), config.model, accuracy(model, data.test),
        train_baseline(config, data) if config.baseline else None,
        {"feature_epsilon": randomiser.feature_epsilon, "label_epsilon": randomiser.label_epsilon,
         "sensitivity_l1": randomiser.sensitivity, "laplace_scale": randomiser.noise_scale},
    )  # fmt: skip
    released = f"{len(features)} records randomised once each"
    return _finish(run, model, run_dir, started, "input-level DP, Laplace + RR", 1, released)


def run_label_training(
    config: TrainConfig, console: Console | None = None, *, resume: Path | None = None
) -> TrainResult:
    """``dpfy train --access label``: label-only DP on a bundled dataset and model."""
    return _run(config, console, resume, _label_body)


def run_input_training(
    config: TrainConfig, console: Console | None = None, *, resume: Path | None = None
) -> TrainResult:
    """``dpfy train --access input``: input-level (local) DP on a bundled dataset and model."""
    return _run(config, console, resume, _input_body)
