"""The settings of ``dpfy tune``, the searches it offers, and the checks run before any data."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpfy._validate import check_count, check_delta, check_positive
from dpfy.plan.accounting.events import GaussianEvent
from dpfy.tune.budget import SELECTION_SHARE, check_tuning_share
from dpfy.tune.clip_search import DEFAULT_CLIP_GRID, ClipSearch
from dpfy.tune.cost import TuningSpec, get_method
from dpfy.tune.random_search import RandomSearch
from dpfy.tune.search import Search, check_grid, check_tolerance
from dpfy.tune.sweep import DEFAULT_LR_GRID, LrClipSweep


@dataclass(frozen=True)
class TuneConfig:
    """Everything ``dpfy tune`` needs; the defaults tune digits in about a minute."""

    dataset: str = "digits"
    search: str = "clip"
    accounting: str | None = None
    trials: int = 5
    #: The whole budget: the final run's report states training and tuning composed, at most this.
    target_epsilon: float = 3.0
    #: Fraction of the budget the trials may spend; None: trials run at the final run's σ.
    tuning_share: float | None = None
    delta: float | None = None
    epochs: float = 20
    trial_epochs: float = 2
    batch_size: int = 128
    model: str = "mlp"
    optimizer: str = "adam"
    lr: float = 0.01  # ClipSearch's lr and the untuned default's
    max_grad_norm: float = 1.0  # the untuned default's C
    clip_grid: tuple[float, ...] = DEFAULT_CLIP_GRID  # ClipSearch's grid and lr-clip's C axis
    lr_grid: tuple[float, ...] = DEFAULT_LR_GRID
    tolerance: float = 0.02
    distribution: str = "poisson"
    #: ε of the exponential mechanism's choice; None: SELECTION_SHARE of the budget.
    selection_epsilon: float | None = None
    public_data: str | None = None
    public_fraction: float = 0.3
    #: Also train the untuned default at the whole budget on the same private data, for
    #: comparison. Off by default: it is a second model trained on the private data, so when on,
    #: its ε is composed into the final run's ledger and the total printed beside its accuracy.
    compare_default: bool = False
    out: Path | None = None
    seed: int | None = None  # private randomness; None: OS entropy (run_config.public_seed)
    data_dir: Path | None = None
    limit: int | None = None

    @property
    def resolved_selection_epsilon(self) -> float:
        """The selection's ε: as given, or a tenth of the budget."""
        if self.selection_epsilon is not None:
            return self.selection_epsilon
        return SELECTION_SHARE * self.target_epsilon

    def spec(self) -> TuningSpec:
        """The accounting method's parameters."""
        return TuningSpec(
            distribution=self.distribution,
            mean_trials=float(self.trials),
            selection_epsilon=self.resolved_selection_epsilon,
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
        lrs=c.lr_grid, clips=c.clip_grid, noise_multiplier=sigma, epochs=c.trial_epochs,
        batch_size=c.batch_size, model=c.model, optimizer=c.optimizer, seed=c.seed,
    ),
    "random": lambda c, sigma: RandomSearch(
        count=c.trials, noise_multiplier=sigma, epochs=c.trial_epochs, batch_size=c.batch_size,
        model=c.model, optimizer=c.optimizer, seed=c.seed,
    ),
}  # fmt: skip


def _check_training_options(config: TuneConfig) -> None:
    """The options ``dpfy train`` has, refused as ``dpfy train`` refuses them."""
    from dpfy.train.models import available_models

    if config.model not in available_models():
        raise ValueError(
            f"unknown model {config.model!r}; choose one of: {', '.join(available_models())}"
        )
    check_count("batch_size", config.batch_size, minimum=1)
    check_positive("max_grad_norm", config.max_grad_norm)
    if config.delta is not None:
        try:
            check_delta(config.delta)
        except ValueError:
            raise ValueError(
                f"delta must lie in (0, 1), got {config.delta!r}; omit --delta for a power of "
                "ten at least 10× below 1/N"
            ) from None
    check_positive("target_epsilon", config.target_epsilon)
    check_tuning_share(config.tuning_share)


def _check_selection(config: TuneConfig) -> None:
    """The exponential mechanism's ε must leave room for the trial runs in the tuning's part."""
    if config.selection_epsilon is not None:
        check_positive("selection_epsilon", config.selection_epsilon)
    room = config.target_epsilon * (config.tuning_share or 1.0)
    if config.resolved_selection_epsilon >= room:
        raise ValueError(
            f"the exponential mechanism's ε ({config.resolved_selection_epsilon:g}) must be below "
            f"the ε the tuning may spend ({room:g}), since the trial runs are paid for too; raise "
            "--tuning-share or --target-epsilon"
        )


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
    if config.trials < 1:
        raise ValueError(f"trials must be at least 1, got {config.trials}")
    _check_training_options(config)
    if method.name == "exponential":
        _check_selection(config)
    if method.private:  # e.g. a geometric number of trials with mean 1, refused before any run
        try:
            method.event([GaussianEvent(1.0)], config.spec())
        except ValueError as error:
            raise ValueError(
                f"--tuning-accounting {method.name}: {error}; the truncated distributions never "
                "draw K = 0, so their mean (--trials) must exceed 1: raise --trials or use "
                "--distribution poisson"
            ) from None


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


__all__ = ["SEARCHES", "TuneConfig", "check_tune_config", "parse_grid"]
