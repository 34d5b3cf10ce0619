"""``dpfy tune``: tune on a bundled dataset, train the chosen configuration, report both costs.

The run: split the data (validation half of the test split for scoring trials, the other half
for final accuracy; for ``public`` tuning, a declared-public part of the training split that the
private run never uses), calibrate σ for the target ε, run the search under the chosen tuning
accounting, train the chosen configuration at the target ε, record the tuning event in that run's
ledger (so its report card shows training ε, tuning ε and the total), train the untuned default
for comparison, and write ``tuning.json``, the PNGs and the final run's report into ``out``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.utils.data import TensorDataset

from dpfy.data.datasets import LoadedDataset, load_dataset
from dpfy.jobs.config import public_seed
from dpfy.plan.accounting.calibrate import calibrate_noise_multiplier
from dpfy.plan.accounting.events import GaussianEvent
from dpfy.tune.clip_search import DEFAULT_CLIP_GRID, ClipSearch
from dpfy.tune.cost import TuningSpec, get_method
from dpfy.tune.random_search import RandomSearch
from dpfy.tune.search import Search, check_grid, check_tolerance
from dpfy.tune.sweep import DEFAULT_LR_GRID, DEFAULT_SWEEP_CLIPS, LrClipSweep
from dpfy.tune.trial import TrialConfig, TrialResult, TuningData, split_indices
from dpfy.tune.tuner import Tuner, TuningOutcome

SUMMARY_FILE = "tuning.json"
NORMS_PLOT = "grad_norms.png"
HEATMAP_PLOT = "lr_clip_heatmap.png"
CLIP_PLOT = "clip_search.png"


@dataclass(frozen=True)
class TuneConfig:
    """Everything ``dpfy tune`` needs; the defaults tune digits in about a minute."""

    dataset: str = "digits"
    search: str = "clip"
    accounting: str | None = None
    trials: int = 5
    target_epsilon: float = 3.0
    delta: float | None = None
    epochs: float = 20
    trial_epochs: float = 2
    batch_size: int = 128
    model: str = "mlp"
    optimizer: str = "adam"
    lr: float = 0.01
    max_grad_norm: float = 1.0  # the untuned default's C
    clip_grid: tuple[float, ...] = DEFAULT_CLIP_GRID
    lr_grid: tuple[float, ...] = DEFAULT_LR_GRID
    sweep_clips: tuple[float, ...] = DEFAULT_SWEEP_CLIPS
    tolerance: float = 0.02
    distribution: str = "poisson"
    selection_epsilon: float = 1.0
    public_data: str | None = None
    public_fraction: float = 0.3
    compare_default: bool = True
    out: Path | None = None
    seed: int | None = None  # private randomness; None: OS entropy (run_config.public_seed)
    data_dir: Path | None = None
    limit: int | None = None

    def spec(self) -> TuningSpec:
        """The accounting method's parameters."""
        return TuningSpec(
            distribution=self.distribution,
            mean_trials=float(self.trials),
            selection_epsilon=self.selection_epsilon,
            public_declaration=self.public_data,
        )


SearchBuilder = Callable[[TuneConfig, float], Search]
SEARCHES: dict[str, SearchBuilder] = {
    "clip": lambda c, sigma: ClipSearch(
        grid=c.clip_grid, tolerance=c.tolerance, lr=c.lr, noise_multiplier=sigma,
        epochs=c.trial_epochs, batch_size=c.batch_size, model=c.model, optimizer=c.optimizer,
        seed=c.seed,
    ),
    "lr-clip": lambda c, sigma: LrClipSweep(
        lrs=c.lr_grid, clips=c.sweep_clips, noise_multiplier=sigma, epochs=c.trial_epochs,
        batch_size=c.batch_size, model=c.model, optimizer=c.optimizer, seed=c.seed,
    ),
    "random": lambda c, sigma: RandomSearch(
        count=c.trials, noise_multiplier=sigma, epochs=c.trial_epochs, batch_size=c.batch_size,
        model=c.model, optimizer=c.optimizer, seed=c.seed,
    ),
}  # fmt: skip


def check_tune_config(config: TuneConfig) -> None:
    """Refuse bad settings before any data is loaded (nothing is written either)."""
    if config.search not in SEARCHES:
        raise ValueError(f"search must be one of {', '.join(SEARCHES)}; got {config.search!r}")
    method = get_method(config.accounting)  # None: refused with the choices listed
    if not method.private and not (config.public_data or "").strip():
        raise ValueError(
            "--tuning-accounting public needs --public-data: declare what the public tuning data "
            "is (here: a split of the training data held out from private training)"
        )
    check_tolerance(config.tolerance)
    check_grid("clip norm", config.clip_grid)
    check_grid("learning rate", config.lr_grid)
    check_grid("clip norm", config.sweep_clips)
    if config.trials < 1:
        raise ValueError(f"trials must be at least 1, got {config.trials}")
    if config.target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be positive, got {config.target_epsilon}")
    if method.private:  # e.g. a geometric number of trials with mean 1, refused before any run
        try:
            method.event([GaussianEvent(1.0)], config.spec())
        except ValueError as error:
            raise ValueError(
                f"--tuning-accounting {method.name}: {error}; the truncated distributions never "
                "draw K = 0, so their mean (--trials) must exceed 1: raise --trials or use "
                "--distribution poisson"
            ) from None


def _take(data: TensorDataset, indices: np.ndarray) -> TensorDataset:
    """The rows ``indices`` of a tensor dataset, as a new tensor dataset."""
    index = torch.as_tensor(indices, dtype=torch.long)
    return TensorDataset(*(t[index] for t in data.tensors))


@dataclass(frozen=True)
class Splits:
    """Tuning train/validation, and the final run's (private) train and held-out test."""

    tuning: TuningData
    final: LoadedDataset
    public_size: int


def make_splits(data: LoadedDataset, config: TuneConfig, public: bool) -> Splits:
    """Validation = a seeded half of the test split; public tuning gets a disjoint train part."""
    validation_idx, test_idx = split_indices(len(data.test), 0.5, public_seed(config.seed))
    validation = _take(data.test, validation_idx)
    final_test = _take(data.test, test_idx)
    private_train, tuning_train, public_size = data.train, data.train, 0
    if public:
        public_idx, private_idx = split_indices(
            len(data.train), config.public_fraction, public_seed(config.seed) + 1
        )
        tuning_train = _take(data.train, public_idx)
        private_train = _take(data.train, private_idx)
        public_size = len(public_idx)
    tuning = TuningData(tuning_train, validation, data.input_shape, data.num_classes)
    final = replace(data, train=private_train, test=final_test)
    return Splits(tuning, final, public_size)


def _resolved_delta(config: TuneConfig, size: int) -> float:
    """δ as given, or a power of ten at least 10× below 1/N (guide §2.1)."""
    if config.delta is not None:
        return config.delta
    return 10.0 ** -(math.ceil(math.log10(size)) + 1)


def _progress(console: Console) -> Progress:
    """A rich progress bar for the trials."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
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


def _pictures(
    search: Search,
    outcome: TuningOutcome,
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
    picked = outcome.chosen.config.max_grad_norm if outcome.chosen else None
    if isinstance(search, ClipSearch) and outcome.results:
        clip = search.summarise(outcome.results, picked)
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
    if best < 2 * chance:
        outcome.notes.append(
            f"the best trial scored {best:.3f}, under twice chance ({chance:.3f}): the trials "
            "are too short or too noisy to choose between configurations; lengthen --trial-epochs"
        )


def run_tuning(config: TuneConfig, console: Console | None = None) -> TuneSummary:
    """Tune, train the chosen configuration and the untuned default, write everything."""
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
    data = load_dataset(config.dataset, data_dir=config.data_dir, limit=config.limit)
    splits = make_splits(data, config, public=not method.private)
    size = len(splits.final.train)
    delta = _resolved_delta(config, size)
    accountant = method.accountant or "pld"
    batch = min(config.batch_size, size)
    steps = max(1, math.ceil(config.epochs * size / batch))
    sigma = calibrate_noise_multiplier(
        config.target_epsilon, delta, batch / size, steps, accountant=accountant
    )
    trial_sigma = 0.0 if (not method.private and config.search == "clip") else sigma
    search = SEARCHES[config.search](config, trial_sigma)
    console.print(
        f"[bold]dpfy tune[/] {config.dataset}: {config.search} search, tuning accounted by "
        f"{method.name} ({method.description}); trials at σ = {trial_sigma:.3f} for "
        f"{config.trial_epochs:g} epoch(s); final run at ε = {config.target_epsilon:g}, "
        f"δ = {delta:g} (σ = {sigma:.3f})"
    )
    tuner = Tuner(search, method.name, config.spec(), seed=config.seed)
    outcome = _run_trials(tuner, splits.tuning, delta, console)
    default = TrialConfig(
        max_grad_norm=config.max_grad_norm, lr=config.lr, noise_multiplier=sigma,
        epochs=config.epochs, batch_size=config.batch_size, model=config.model,
        optimizer=config.optimizer, seed=config.seed,
    )  # fmt: skip
    chosen = default
    if outcome.chosen is not None:
        chosen = default.with_(
            max_grad_norm=outcome.chosen.config.max_grad_norm, lr=outcome.chosen.config.lr
        )
    final = train_final(
        chosen, splits.final, config.target_epsilon, delta, accountant, outcome,
        out / "final", console, dataset_name=data.name,
    )  # fmt: skip
    baseline = None
    if config.compare_default:
        baseline = train_final(
            default, splits.final, config.target_epsilon, delta, accountant, None,
            None, console, dataset_name=data.name,
        )  # fmt: skip
    files: dict[str, Path] = {"report": out / "final" / "report.md"}
    extra = _pictures(search, outcome, config, chosen.max_grad_norm, sigma, out, files)
    _check_informative(outcome, data.num_classes)
    for note in outcome.notes:
        console.print(f"[yellow]note:[/] {note}")
    summary = {
        "config": json.loads(json.dumps(asdict(config), default=str)),
        "delta": delta,
        "noise_multiplier": sigma,
        "trial_noise_multiplier": trial_sigma,
        "public_tuning_examples": splits.public_size,
        "private_training_examples": size,
        "validation_examples": len(splits.tuning.validation),
        "test_examples": len(splits.final.test),
        "tuning": outcome.to_dict(),
        **extra,
        "final": final,
        "untuned_default": baseline,
        "not_covered_by_epsilon": _uncovered(baseline is not None, bool(outcome.results)),
        "seconds": time.perf_counter() - started,
        "files": {k: str(v) for k, v in files.items()},
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
    files["summary"] = out / SUMMARY_FILE
    return TuneSummary(out, summary, files)


def _uncovered(baseline: bool, trials: bool) -> list[str]:
    """What this summary holds beyond the final ledger's ε, so nobody publishes it by mistake."""
    notes = []
    if trials:
        notes.append(
            "grad_norm_quantiles and the gradient-norm histogram: unclipped per-example gradient "
            "norms of the training data, computed without noise (diagnostics for the curator)"
        )
    if baseline:
        notes.append(
            "untuned_default: a second model trained on the same private data, accounted only in "
            "its own ledger; publishing its result spends its ε as well, on top of the final "
            "run's total"
        )
    return notes


def parse_grid(text: str | Sequence[float]) -> tuple[float, ...]:
    """'0.1,0.3,1' → (0.1, 0.3, 1.0); an empty text is an empty grid (refused later)."""
    if not isinstance(text, str):
        return tuple(float(v) for v in text)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"a grid is comma-separated numbers, e.g. 0.1,0.3,1; got {text!r}"
        ) from None


__all__ = [
    "SEARCHES",
    "SUMMARY_FILE",
    "Splits",
    "TuneConfig",
    "TuneSummary",
    "check_tune_config",
    "make_splits",
    "parse_grid",
    "run_tuning",
]
