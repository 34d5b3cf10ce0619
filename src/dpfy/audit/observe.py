"""Run the private step with canaries and record what a white-box auditor sees.

The audit session is built by :func:`dpfy.train.builder.make_private` with the audited run's
own settings — its sampler and rate q = B/N, σ, C, expected batch size B, algorithm, clipping
unit and noise mechanism — on the canary records of :mod:`dpfy.audit.canaries`, so the
canaries reach the update only through the run's sampler, clipping, noise, divisor and ledger.
The auditor sees every intermediate model (the white-box threat model of Nasr et al. 2023): the
observed update of each step, −Δθ (SGD, learning rate 1), normalised by B/C so that a clipped
canary adds exactly 1 (sensitivity C) and the noise has std σ.

A matrix-factorisation run (BandMF, BLT: ``plan.strategy`` is set) is re-run whole: its
settings carry the planned steps T and the strategy, the audit session plans the same T steps
with the same bands or buffers (the optimisers are deterministic, so the strategy comes out the
same, and a session whose plan differs is refused), and one block is the whole run
(:mod:`dpfy.audit.correlated`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dpfy.audit.canaries import CanaryDesign, CanaryModel, canary_rows
from dpfy.data.loader import rest_of_run
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.correlated.banded import BandedStrategy
from dpfy.plan.correlated_events import CORRELATED_MECHANISMS, decode_strategy
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.train.builder import make_private

#: The samplers make_private names for DP-FTRL, from the plan's sampler names.
_TREE_SAMPLERS = {"tree-shuffle": "shuffle", "tree-fixed-order": "fixed-order"}
#: The algorithms whose noise is a matrix factorisation's (a strategy in the plan).
FACTORISED_ALGORITHMS = tuple(CORRELATED_MECHANISMS.values())


@dataclass(frozen=True)
class StepSettings:
    """The private step an audit re-runs: the settings of the audited run, nothing else.

    ``records`` and ``batch_size`` count what the run samples (examples, or users at user
    level), so q = batch_size / records as in the run.
    """

    records: int
    batch_size: int
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    algorithm: str = "dp-sgd"
    unit: str = "example"
    sampler: str | None = None
    accountant: str = "pld"
    relation: str = "add-or-remove"
    restart_every: int | None = None
    tree: str | None = None
    loss_reduction: str = "mean"
    #: Matrix-factorisation runs only: the planned steps T (one whole run), the plan's
    #: mechanism ("banded-mf", "blt") and its strategy tuple (None: planned by the first session).
    steps: int | None = None
    mechanism: str = "gaussian"
    strategy: tuple[float, ...] | None = None

    @classmethod
    def from_plan(cls, plan: PrivacyPlan) -> StepSettings:
        """The step of a run's plan (``PrivateTraining.plan``, or a run directory's)."""
        if plan.microbatch_size is not None:
            raise ValueError(
                "a white-box audit of microbatch clipping is not supported: a canary would share "
                "its microbatch with other records; audit the run without microbatch_size"
            )
        if plan.world_size != 1:
            raise ValueError("audit a distributed run's step in one process (world_size 1)")
        factorised = plan.strategy is not None
        return cls(
            records=plan.dataset_size,
            batch_size=plan.expected_batch_size,
            noise_multiplier=plan.noise_multiplier,
            max_grad_norm=plan.max_grad_norm,
            delta=plan.delta,
            algorithm=plan.algorithm,
            unit=plan.unit,
            sampler=_TREE_SAMPLERS.get(plan.sampler, plan.sampler),
            accountant=plan.accountant,
            relation=plan.relation,
            restart_every=plan.restart_every,
            tree=plan.tree,
            loss_reduction=plan.loss_reduction,
            steps=plan.steps if factorised else None,
            mechanism=plan.mechanism,
            strategy=plan.strategy,
        )

    @property
    def factorised(self) -> bool:
        """Whether the run's noise is a matrix factorisation's (BandMF, BLT), correlated over
        the whole run."""
        return self.algorithm in FACTORISED_ALGORITHMS

    def strategy_size(self) -> dict[str, int]:
        """The bands (BandMF) or buffers (BLT) that plan this run's strategy again; {} when the
        strategy is not known yet (the resolver's default then)."""
        if self.strategy is None:
            return {}
        strategy = decode_strategy(self.mechanism, self.strategy)
        if isinstance(strategy, BandedStrategy):
            return {"bands": strategy.bands}
        return {"buffers": max(1, strategy.buffers)}

    def calibrated(self, epsilon: float, blocks: int = 1) -> StepSettings:
        """These settings with σ calibrated so that ``blocks`` blocks (trials) claim ``epsilon``.

        Calibrated by make_private itself (its accountant and resolver), on the audit records.
        A matrix-factorisation run's block is the whole run (``blocks`` must be 1), and its
        planned mechanism, strategy, sampler and relation are filled in from the plan.
        """
        if self.factorised and blocks != 1:
            raise ValueError(
                f"one block of a {self.algorithm} audit is the whole run of {self.steps} steps; "
                "calibrate it with blocks=1"
            )
        rows = _Rows(torch.zeros(0, 1), self.records)
        steps = blocks * self.steps_per_block
        private = _private_session(self, CanaryModel(1), rows, steps, 0, epsilon)
        private.engine.detach()
        calibrated = dataclasses.replace(self, noise_multiplier=private.plan.noise_multiplier)
        return calibrated.planned_as(private.plan) if self.factorised else calibrated

    def planned_as(self, plan: PrivacyPlan) -> StepSettings:
        """A matrix-factorisation audit's settings with what ``plan`` fixed: its mechanism,
        strategy, sampler and relation (σ stays these settings')."""
        return dataclasses.replace(
            self,
            mechanism=plan.mechanism,
            strategy=plan.strategy,
            sampler=plan.sampler,
            relation=plan.relation,
            steps=plan.steps,
        )

    @property
    def steps_per_block(self) -> int:
        """Steps of one independent trial: one step, one epoch of DP-FTRL's trees, or the
        whole run of a matrix-factorisation mechanism.

        DP-FTRL's noise is correlated across the steps of a tree, so its steps are not
        independent trials; an epoch (whole trees, the canary once) is. BandMF's and BLT's noise
        is correlated across the whole run, so only the whole run is.
        """
        if self.factorised:
            if self.steps is None:
                raise ValueError(
                    f"a {self.algorithm} audit re-runs the whole run: give its planned steps "
                    "(StepSettings(steps=T), or StepSettings.from_plan)"
                )
            return self.steps
        if self.algorithm == "dp-ftrl":
            return self.records // self.batch_size
        return 1


@dataclass(frozen=True)
class Session:
    """One audit session: the normalised update of every step on every coordinate, its claim.

    ``updates`` has one row per step; ``claimed_block_epsilon`` is the ledger's ε after one
    block (one trial) and ``claimed_epsilon`` after the whole session, both at the run's δ.
    """

    updates: np.ndarray
    claimed_block_epsilon: float
    claimed_epsilon: float
    #: The session's ledger event and relation (the claim the f-DP one-run audit tests).
    claimed_event: DpEvent | None = None
    relation: str = "add-or-remove"

    def blocks(self, steps_per_block: int) -> np.ndarray:
        """The updates summed over each block of steps: one row per independent trial."""
        usable = self.updates.shape[0] // steps_per_block * steps_per_block
        rows = self.updates[:usable]
        return rows.reshape(-1, steps_per_block, rows.shape[1]).sum(axis=1)


def run_session(
    settings: StepSettings,
    design: CanaryDesign,
    included: torch.Tensor,
    blocks: int,
    seed: int | None,
    on_step: Callable[[], None] | None = None,
) -> Session:
    """Train the audit model for ``blocks`` trials on the canaries in ``included`` and watch it.

    ``on_step`` is called after every step (a progress bar). A matrix-factorisation run is
    re-run whole, with the auditor's knowledge of each canary's steps, by
    :func:`dpfy.audit.correlated.run_factorised_session` instead.
    """
    if settings.factorised:
        raise ValueError(
            f"a {settings.algorithm} session is one whole run: use "
            "dpfy.audit.correlated.run_factorised_session"
        )
    rows = _Rows(canary_rows(design, included, settings.relation), design.blanks)
    steps = blocks * settings.steps_per_block
    model = CanaryModel(design.coordinates)
    private = _private_session(settings, model, rows, steps, seed)
    try:
        watched = watch_updates(private, model, settings, steps, on_step, settings.steps_per_block)
    finally:
        private.engine.detach()
    scale = settings.batch_size / settings.max_grad_norm
    return Session(
        watched.updates * scale,
        watched.epsilon_at_mark,
        watched.epsilon,
        watched.event,
        watched.relation,
    )


@dataclass(frozen=True)
class Watched:
    """What the auditor saw of one session: each step's update (−Δθ, un-normalised, one row per
    step taken), the ledger's ε after ``mark`` steps (NaN if the session stopped earlier) and
    after the last step, both at the run's δ."""

    updates: np.ndarray
    epsilon_at_mark: float
    epsilon: float
    #: What the session's ledger accounted (every step, as one event), under which relation.
    event: DpEvent | None = None
    relation: str = "add-or-remove"


def watch_updates(
    private,  # PrivateTraining (not imported: its module is the builder's)
    model: CanaryModel,
    settings: StepSettings,
    total: int,
    on_step: Callable[[], None] | None = None,
    mark: int | None = None,
) -> Watched:
    """Step the audit session up to ``total`` times and record every update: the audit loop.

    Every white-box session (one step, a DP-FTRL epoch, a whole matrix-factorisation run) is
    this loop, so they observe the private step the same way: the run's own loader, loss
    reduction and optimizer step, the weights read before and after (SGD at learning rate 1,
    so −Δθ is the released noisy gradient). ``on_step`` is called after every step.
    """
    updates = np.empty((total, model.weights.numel()))
    at_mark = math.nan
    step = 0
    previous = model.weights.clone()
    with warnings.catch_warnings():  # the audited run's own choices were warned about already
        warnings.simplefilter("ignore")
        for batch in rest_of_run(private.loader):
            private.optimizer.zero_grad()
            _loss(model(batch), settings.loss_reduction).backward()
            private.optimizer.step()
            current = model.weights.clone()
            updates[step] = (previous - current).numpy()
            previous = current
            step += 1
            if on_step is not None:
                on_step()
            if step == mark:
                at_mark = private.epsilon()
            if step == total:
                break
        claimed = private.epsilon()
    ledger = private.ledger
    return Watched(updates[:step], at_mark, claimed, ledger.events(), ledger.relation.value)


def _private_session(
    settings: StepSettings,
    model: CanaryModel,
    rows: _Rows,
    steps: int,
    seed: int | None,
    target_epsilon: float | None = None,
):  # -> PrivateTraining (not imported: its module is the builder's)
    """make_private with the audited run's settings on the canary records (SGD, lr 1).

    With ``target_epsilon`` σ is calibrated to it instead of taken from the settings.
    """
    options = dataclasses.asdict(settings)
    user_ids = torch.arange(len(rows)) if settings.unit == "user" else None
    with warnings.catch_warnings():  # δ ≥ 1/N is the audited run's choice, not the audit's
        warnings.simplefilter("ignore", UserWarning)
        return make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            rows,
            batch_size=settings.batch_size,
            delta=settings.delta,
            max_grad_norm=settings.max_grad_norm,
            noise_multiplier=None if target_epsilon is not None else settings.noise_multiplier,
            target_epsilon=target_epsilon,
            steps=steps,
            accountant=settings.accountant,
            sampler=options["sampler"],
            algorithm=settings.algorithm,
            restart_every=settings.restart_every,
            tree=settings.tree,
            loss_reduction=settings.loss_reduction,  # type: ignore[arg-type]
            user_ids=user_ids,
            seed=seed,
            engine="auto",
            loader_options={"collate_fn": _collate},
            **settings.strategy_size(),
        )


class _Rows(torch.utils.data.Dataset):
    """The canaries' rows, then ``blanks`` rows of zeros made when fetched (never all stored).

    A batch is fetched in one indexing (``__getitems__``), not row by row.
    """

    def __init__(self, canaries: torch.Tensor, blanks: int) -> None:
        self.canaries = canaries
        self.blanks = blanks

    def __len__(self) -> int:
        return self.canaries.shape[0] + self.blanks

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        index = torch.as_tensor(indices, dtype=torch.long)
        rows = torch.zeros(index.numel(), self.canaries.shape[1])
        mine = index < self.canaries.shape[0]
        rows[mine] = self.canaries[index[mine]]
        return rows


def _collate(samples: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A fetched block of rows as it is; a list of single rows (the loader's template) stacked."""
    if isinstance(samples, torch.Tensor):
        return samples
    return torch.stack(list(samples))


def _loss(outputs: torch.Tensor, reduction: str) -> torch.Tensor:
    """The audit model's loss under the run's reduction (the engine undoes a mean itself)."""
    if outputs.numel() == 0:
        return outputs.sum()
    return outputs.mean() if reduction == "mean" else outputs.sum()


__all__ = [
    "FACTORISED_ALGORITHMS",
    "Session",
    "StepSettings",
    "Watched",
    "run_session",
    "watch_updates",
]
