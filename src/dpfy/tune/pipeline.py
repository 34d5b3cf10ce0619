"""``dpfy tune``: tune on a bundled dataset, train the chosen configuration, report both costs.

The run: split the data (validation half of the test split for scoring trials, the other half
for final accuracy; for ``public`` tuning, a declared-public part of the training split that the
private run never uses), split the total ε between the trials and the final run and calibrate
both σ so the total holds (:mod:`dpfy.tune.budget`), run the search under the chosen tuning
accounting, train the chosen configuration, record the tuning event in that run's ledger (so its
report card shows training ε, tuning ε and their total, at most the budget), and write
``tuning.json``, the PNGs and the final run's report into ``out``.

Every model trained on the private data is inside the total the final ledger states. The untuned
default at the whole budget — what not tuning would give — is a second model on the same data,
so it is trained only on request (``compare_default``, ``--compare-default``), and then its
ledger's events join the final run's under the label ``untuned-default``: the report and the
printed total compose it with training and tuning, beyond the budget and saying so, and its
accuracy is never shown beside a total that leaves it out.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dpfy.plan.accounting.events import DpEvent
from dpfy.tune.budget import BudgetSplit, plan_budget
from dpfy.tune.clip_search import ClipChoice, ClipSearch
from dpfy.tune.config import SEARCHES, TuneConfig, check_tune_config, parse_grid
from dpfy.tune.cost import TuningAccounting, get_method
from dpfy.tune.datasets import load_tuning_dataset
from dpfy.tune.grid_edge import search_edges, warn_grid_edges
from dpfy.tune.search import Search
from dpfy.tune.splits import Splits, make_splits, resolved_delta
from dpfy.tune.sweep import LrClipSweep
from dpfy.tune.trial import TrialConfig, TrialResult, TuningData
from dpfy.tune.tuner import Tuner, TuningOutcome, planned_event

SUMMARY_FILE = "tuning.json"
#: The final ledger's label for the untuned default run (``compare_default``); the report card
#: says what it is (:data:`dpfy.report.accounting_sections.OTHER_RELEASES`).
UNTUNED_LABEL = "untuned-default"
NORMS_PLOT = "grad_norms.png"
HEATMAP_PLOT = "lr_clip_heatmap.png"
CLIP_PLOT = "clip_search.png"


def _progress(console: Console) -> Progress:
    """A rich progress bar for the trials."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),  # the estimate the issue asked for (trials take minutes)
        console=console,
    )


def _run_trials(tuner: Tuner, data: TuningData, delta: float, console: Console) -> TuningOutcome:
    """Run the tuner with a progress bar (the total is known once K is drawn)."""
    with _progress(console) as progress:
        task = progress.add_task(f"tuning ({tuner.search.name})", total=None, last="")

        def on_trial(index: int, total: int, result: TrialResult) -> None:
            last = (
                f"C={result.config.max_grad_norm:g} lr={result.config.lr:g} "
                f"val acc {result.accuracy:.3f}"
            )
            progress.update(task, total=total, completed=index + 1, last=last)

        return tuner.run(data, delta, on_trial)


@dataclass
class TuneSummary:
    """What ``dpfy tune`` measured and wrote."""

    out: Path
    summary: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)


def _clip_choice(search: Search, outcome: TuningOutcome) -> ClipChoice | None:
    """ClipSearch's summary of its trials (None for other searches or no trials)."""
    if not isinstance(search, ClipSearch) or not outcome.results:
        return None
    picked = outcome.chosen.config.max_grad_norm if outcome.chosen else None
    return search.summarise(outcome.results, picked)


def _pictures(
    search: Search,
    outcome: TuningOutcome,
    clip: ClipChoice | None,
    config: TuneConfig,
    chosen_clip: float,
    sigma: float,
    out: Path,
    files: dict[str, Path],
) -> dict[str, Any]:
    """Draw the tuning PNGs into ``out`` (paths added to ``files``); return their JSON facts."""
    from dpfy.tune.plots import plot_clip_search, plot_grad_norms, plot_lr_clip_heatmap

    norms = [r.norms for r in outcome.results if r.norms.size]
    extra: dict[str, Any] = {}
    if norms:
        files["grad_norms_plot"] = plot_grad_norms(
            np.concatenate(norms), chosen_clip, out / NORMS_PLOT,
            default_clip=config.max_grad_norm,
        )  # fmt: skip
    if clip is not None:
        if clip.indistinct and len(clip.accuracy_by_clip) > 1:
            outcome.notes.append(
                "every clip norm tried scored within the tolerance of the best: the trials did "
                "not tell them apart, so the smallest C was taken; lengthen --trial-epochs"
            )
        extra["clip_search"] = {
            "statement": clip.statement(),
            "accuracy_by_clip": {f"{c:g}": a for c, a in clip.accuracy_by_clip.items()},
            "grad_norm_quantiles": clip.norm_quantiles,
        }
        picked = outcome.chosen.config.max_grad_norm if outcome.chosen else None
        files["clip_plot"] = plot_clip_search(
            clip.accuracy_by_clip, picked, config.tolerance, out / CLIP_PLOT
        )
    if isinstance(search, LrClipSweep) and outcome.chosen is not None:
        grid = search.grid(outcome.results, outcome.chosen)
        extra["sweep"] = grid.to_dict()
        files["heatmap"] = plot_lr_clip_heatmap(grid, out / HEATMAP_PLOT, noise_multiplier=sigma)
    return extra


def _check_informative(outcome: TuningOutcome, num_classes: int) -> None:
    """Note trials whose best score is near chance: their choice is noise, not signal."""
    if not outcome.results:
        return
    best = max(r.accuracy for r in outcome.results)
    chance = 1.0 / num_classes
    # Twice chance is "near" with many classes, but with two it is perfect accuracy: the bar is
    # the lower of twice chance and chance + 0.1, so a binary task is noted only near 0.5.
    near = min(2 * chance, chance + 0.1)
    if best < near:
        bar = "twice chance" if near == 2 * chance else "chance + 0.1"
        outcome.notes.append(
            f"the best trial scored {best:.3f}, under {bar} ({near:.3f}; chance is "
            f"{chance:.3f}): the trials are too short or too noisy to choose between "
            "configurations; lengthen --trial-epochs"
        )


def _split_budget(
    config: TuneConfig, method: TuningAccounting, splits: Splits, delta: float
) -> BudgetSplit:
    """Both σ for the total budget, from the events the trials and the final run will record."""
    final_size, tuning_size = len(splits.final.train), len(splits.tuning.train)  # type: ignore[arg-type]
    final = _default_config(config, 1.0)

    def training_at(sigma: float) -> DpEvent:
        return planned_event(final.with_(noise_multiplier=sigma), final_size)  # type: ignore[return-value]

    def tuning_at(sigma: float) -> DpEvent:
        candidates = SEARCHES[config.search](config, sigma).candidates()
        trials = [planned_event(c, tuning_size) for c in candidates]
        return method.event([e for e in trials if e is not None], config.spec())

    accountant = method.accountant or "pld"
    return plan_budget(
        config.target_epsilon, delta, accountant, training_at,
        tuning_at if method.private else None, config.tuning_share,
    )  # fmt: skip


def _default_config(config: TuneConfig, sigma: float) -> TrialConfig:
    """The untuned default as a full-length run: the config's lr and C."""
    return TrialConfig(
        max_grad_norm=config.max_grad_norm, lr=config.lr, noise_multiplier=sigma,
        epochs=config.epochs, batch_size=config.batch_size, model=config.model,
        optimizer=config.optimizer, seed=config.seed,
    )  # fmt: skip


def _check_tuning_event(outcome: TuningOutcome, split: BudgetSplit) -> None:
    """The tuning that ran must be the tuning the budget was split for, or the total is wrong."""
    if outcome.method.private and outcome.event != split.tuning_event:
        raise RuntimeError(
            f"the tuning recorded {outcome.event} but the budget was planned for "
            f"{split.tuning_event}; the final run was not started — please report this"
        )


def run_tuning(config: TuneConfig, console: Console | None = None) -> TuneSummary:
    """Tune, train the chosen configuration (and the untuned default on request), write it all."""
    from dpfy.jobs.run_dir import prepare_run_dir
    from dpfy.tune.final import train_final

    console = console or Console()
    check_tune_config(config)
    method = get_method(config.accounting)
    target = config.out or Path("runs") / f"tune-{config.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (target / SUMMARY_FILE).exists():
        raise ValueError(
            f"{target} already holds a tuning run ({SUMMARY_FILE} exists); choose another --out "
            "directory — an existing run is never overwritten"
        )
    out = prepare_run_dir(target)
    started = time.perf_counter()
    tuning_data = load_tuning_dataset(config.dataset, config.data_dir, config.limit)
    data = tuning_data.data
    splits = make_splits(data, config, public=not method.private)
    size = len(splits.final.train)
    delta = resolved_delta(config, size)
    accountant = method.accountant or "pld"
    split = _split_budget(config, method, splits, delta)
    sigma = split.final_noise_multiplier
    zero_noise = not method.private and config.search == "clip"  # the guide's public sweep
    trial_sigma = 0.0 if zero_noise else split.trial_noise_multiplier
    search = SEARCHES[config.search](config, trial_sigma)
    console.print(
        f"[bold]dpfy tune[/] {config.dataset}: {config.search} search, tuning accounted by "
        f"{method.name} ({method.description}); total budget ε = {config.target_epsilon:g} at "
        f"δ = {delta:g}: trials at σ = {trial_sigma:.3f} for {config.trial_epochs:g} epoch(s) "
        f"(ε_tuning {split.tuning_epsilon:.3f}), final run at σ = {sigma:.3f} (ε_training "
        f"{split.training_epsilon:.3f}), total {split.planned_total:.3f}"
        + (
            "; --compare-default: the untuned default also trains on the private data at the "
            f"whole ε = {config.target_epsilon:g}, and its ε is composed into the total"
            if config.compare_default
            else ""
        )
    )
    tuner = Tuner(search, method.name, config.spec(), seed=config.seed)
    outcome = _run_trials(tuner, splits.tuning, delta, console)
    _check_tuning_event(outcome, split)
    default = _default_config(config, sigma)
    chosen = default
    if outcome.chosen is not None:
        chosen = default.with_(
            max_grad_norm=outcome.chosen.config.max_grad_norm, lr=outcome.chosen.config.lr
        )
    clip = _clip_choice(search, outcome)
    edges = [] if outcome.chosen is None else search_edges(search, outcome.chosen.config, clip)
    baseline, others = None, {}
    if config.compare_default:  # what not tuning gives: the whole budget on one run
        baseline = train_final(
            default, splits.final, config.target_epsilon, delta, accountant, None,
            None, console, dataset_name=data.name,
        )  # fmt: skip
        others[UNTUNED_LABEL] = baseline.pop("events")  # spent on the same private data
    final = train_final(
        chosen, splits.final, split.training_epsilon, delta, accountant, outcome,
        out / "final", console, dataset_name=data.name, total_budget=config.target_epsilon,
        public_inputs=tuning_data.public_inputs,
        grid_edges=tuple(edge.message() for edge in edges), other_releases=others,
    )  # fmt: skip
    final.pop("events")
    files: dict[str, Path] = {"report": out / "final" / "report.md"}
    extra = _pictures(search, outcome, clip, config, chosen.max_grad_norm, sigma, out, files)
    _check_informative(outcome, data.num_classes)
    for note in outcome.notes:
        console.print(f"[yellow]note:[/] {note}")
    summary = {
        "config": json.loads(json.dumps(asdict(config), default=str)),
        "delta": delta,
        "budget": split.to_dict(),
        "noise_multiplier": sigma,
        "trial_noise_multiplier": trial_sigma,
        "public_tuning_examples": splits.public_size,
        "private_training_examples": size,
        "validation_examples": len(splits.tuning.validation),
        "test_examples": len(splits.final.test),
        "tuning": outcome.to_dict(),
        "grid_edges": [edge.message() for edge in edges],
        **extra,
        "final": final,
        "untuned_default": baseline,
        "not_covered_by_epsilon": _uncovered(bool(outcome.results)),
        "seconds": time.perf_counter() - started,
        "files": {k: str(v) for k, v in files.items()},
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
    files["summary"] = out / SUMMARY_FILE
    warn_grid_edges(edges)
    return TuneSummary(out, summary, files)


def _uncovered(trials: bool) -> list[str]:
    """What this summary holds beyond the final ledger's ε, so nobody publishes it by mistake.

    The untuned default, when trained, is not listed: its ε is in the final ledger's total.
    """
    notes = []
    if trials:
        notes.append(
            "grad_norm_quantiles and the gradient-norm histogram: unclipped per-example gradient "
            "norms of the training data, computed without noise (diagnostics for the curator)"
        )
    return notes


__all__ = [
    "SEARCHES",
    "SUMMARY_FILE",
    "UNTUNED_LABEL",
    "Splits",
    "TuneConfig",
    "TuneSummary",
    "check_tune_config",
    "make_splits",
    "parse_grid",
    "run_tuning",
]
