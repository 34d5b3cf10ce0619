"""Audit the user's own model, loss and collate: a canary record through their code, ε̂ of a step.

The step audits of :mod:`dpfy.audit.fdp` and :mod:`dpfy.audit.whitebox` run dpfy's private step
on a canary model, so a coupling between examples in the user's own model (a batch-mean
subtraction in ``forward``, batch statistics) or loss never reaches them. This audit runs the
user's model (a copy), loss and data through make_private instead, with the run's σ and C, and
asks the question DP answers: how far does one record move the released gradient?

**The mechanism audited.** One full-batch step (q = 1) on n records of the user's data, with and
without a canary record (an *input* canary: a record of the user's data, its input scaled up so
that a coupling would carry it into the other records' gradients). The released gradient is
``(S + N(0, σ²C² I)) / B``, S the sum of the clipped per-example gradients; per-example
independence means the canary changes S by its own clipped gradient only: ‖S_in − S_out‖ ≤ C.
A coupling lets it change every other record's gradient too, and ‖S_in − S_out‖ can reach B·C.
The session's optimizer has learning rate 0 and the behaviour checks are off (the audit is the
check): the model never moves, and each step is a fresh draw of the same mechanism.

**The statistic and the bound.** The auditor knows the model, the data and the canary, so it
may compute the direction the canary moves the sum, u = S_in − S_out, without noise (two
noise-free steps of the same code, before any audited trial); each audited step's released
gradient g (times B) is projected onto u/‖u‖ and divided by C. In the claimed mechanism that
projection is N(⟨S, u⟩/(‖u‖C), σ²) on each side: a Gaussian shift of ‖u‖/C ≤ 1 in units of σ,
so the step's tradeoff is G_μ with μ ≤ 1/σ, and the f-DP bound of :mod:`dpfy.audit.tradeoff`
(q = 1) applies exactly: ε̂ > ε (the session's ledger for this one step) at confidence c means
the user's code lets one record move the release by more than C.

**What it does not cover.** Sampling (the step is full-batch), the run's own data beyond the n
records used, and what happens across steps; the step audits cover the sampler and noise.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from dpfy.audit.result import AuditResult
from dpfy.audit.tradeoff import tradeoff_bound
from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.loader import rest_of_run
from dpfy.train.builder import make_private

#: Records of the user's data beside the canary, and audited steps a side, when not given.
DEFAULT_RECORDS = 63
DEFAULT_STEPS = 200
#: How much larger than the user's record the canary's input is (a coupling then shows).
CANARY_SCALE = 100.0
#: The noise multiplier of the noise-free sessions that find the direction u (no claim is made
#: about them: they only choose the statistic).
_NOISE_FREE = 1e-9

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _WithCanary(Dataset):
    """The user's first ``records`` records, then (``present``) the canary record."""

    def __init__(self, records: Dataset, canary: Any, present: bool) -> None:
        self.records = records
        self.canary = canary
        self.present = present

    def __len__(self) -> int:
        return len(self.records) + int(self.present)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        if index == len(self.records):  # type: ignore[arg-type]
            return self.canary
        return self.records[index]


def input_canary(
    record: Sequence[Any], model: nn.Module | None = None, scale: float = CANARY_SCALE
) -> tuple[Any, ...]:
    """The user's record with its (floating-point) input scaled by ``scale``; a class target is
    replaced by the class ``model`` finds least likely for it, so its loss gradient is large
    (a large input the model gets right has almost none)."""
    x, y, *rest = record
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        x = x * scale
    is_class = isinstance(y, torch.Tensor) and y.ndim == 0 and not y.is_floating_point()
    if model is not None and is_class and isinstance(x, torch.Tensor):
        with torch.no_grad():
            y = copy.deepcopy(model).eval()(x[None]).reshape(-1).argmin().to(y.dtype)
    return (x, y, *rest)


def audit_user_model(
    model: nn.Module,
    dataset: Dataset,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    delta: float,
    criterion: Criterion = nn.functional.cross_entropy,
    records: int = DEFAULT_RECORDS,
    steps: int = DEFAULT_STEPS,
    canary: Any | None = None,
    confidence: float = 0.95,
    seed: int | None = None,
    accountant: str = "pld",
    loader_options: dict[str, Any] | None = None,
    on_step: Callable[[], None] | None = None,
) -> AuditResult:
    """ε̂ of one full-batch step of the user's model and loss with the run's σ and C.

    ``model`` is copied (never trained); ``dataset`` yields ``(input, target)`` records, the
    first ``records`` of which are used; ``canary`` defaults to :func:`input_canary` of record
    ``records`` (the next one), its input scaled up and its class the least likely one.
    ``loader_options`` go to the loader (a ``collate_fn`` of yours).
    """
    if len(dataset) <= records:  # type: ignore[arg-type]
        raise ValueError(
            f"the audit uses {records} records and one more as the canary, but the dataset has "
            f"{len(dataset)}; pass fewer records"  # type: ignore[arg-type]
        )
    if steps < 10:
        raise ValueError(f"the audit needs at least 10 steps a side, got {steps}")
    start = time.perf_counter()
    base = Subset(dataset, range(records))
    canary = input_canary(dataset[records], model) if canary is None else canary
    settings = {
        "max_grad_norm": max_grad_norm,
        "delta": delta,
        "criterion": criterion,
        "accountant": accountant,
        "loader_options": loader_options,
    }
    direction = _noise_free(model, base, canary, True, settings) - _noise_free(
        model, base, canary, False, settings
    )
    size = float(np.linalg.norm(direction))
    if size == 0.0:
        raise ValueError(
            "the canary does not move the gradient at all (its loss gradient is 0); pass "
            "canary= a record whose loss has a gradient"
        )
    unit = direction / size
    seeds = (None, None) if seed is None else (2 * seed, 2 * seed + 1)
    scores_in, claimed = _released(model, base, canary, True, steps, noise_multiplier,
                                   settings, seeds[0], on_step)  # fmt: skip
    scores_out, _ = _released(model, base, canary, False, steps, noise_multiplier, settings,
                              seeds[1], on_step)  # fmt: skip
    bound = tradeoff_bound(
        (scores_in @ unit) / max_grad_norm, (scores_out @ unit) / max_grad_norm, 1.0, confidence
    )
    epsilon = bound.epsilon(delta, accountant)
    return AuditResult(
        method="f-dp",
        epsilon_lower_bound=epsilon,
        confidence=confidence,
        delta=delta,
        canaries=1,
        runs=2,
        guesses=bound.positives + bound.negatives,
        correct=bound.positives + bound.negatives - bound.false_positives - bound.false_negatives,
        seconds=time.perf_counter() - start,
        claimed_epsilon=claimed,
        threat_model="white-box",
        scope="user-model",
        notes=(
            f"one full-batch step (q = 1) of your model and loss on {records} of your records, "
            f"with and without one input canary; {steps} steps a side, each a trial",
            f"the canary moves the noise-free clipped sum by {size / max_grad_norm:.4g}·C "
            "(per-example independence allows at most 1·C)",
            f"μ̂ = {bound.mu:.4g} against the claimed μ = 1/σ = {1 / noise_multiplier:.4g} "
            f"(FPR ≤ {bound.fpr_upper:.4g}, FNR ≤ {bound.fnr_upper:.4g} on the held-out "
            "trials); ε̂ and the claim are of this one step",
        ),
    )


def _session(model: nn.Module, base: Dataset, canary: Any, present: bool, steps: int,
             noise_multiplier: float, settings: dict, seed: int | None):  # fmt: skip
    """make_private on a copy of the model: lr 0, full batch, behaviour checks off."""
    copied = copy.deepcopy(model)
    data = _WithCanary(base, canary, present)
    with warnings.catch_warnings():  # δ ≥ 1/N and a tiny σ are the audit's own choices
        warnings.simplefilter("ignore")
        private = make_private(
            copied,
            torch.optim.SGD(copied.parameters(), lr=0.0),
            data,
            batch_size=len(data),
            delta=settings["delta"],
            max_grad_norm=settings["max_grad_norm"],
            noise_multiplier=noise_multiplier,
            steps=steps,
            accountant=settings["accountant"] if noise_multiplier > _NOISE_FREE else "rdp",
            seed=seed,
            behaviour_checks=CheckSchedule(first=0, every=None),
            loader_options=settings["loader_options"],
        )
    return copied, private


def _released(model: nn.Module, base: Dataset, canary: Any, present: bool, steps: int,
              noise_multiplier: float, settings: dict, seed: int | None,
              on_step: Callable[[], None] | None = None) -> tuple[np.ndarray, float]:  # fmt: skip
    """Each step's released gradient times B (steps × parameters), and the claim of one step."""
    copied, private = _session(model, base, canary, present, steps, noise_multiplier,
                               settings, seed)  # fmt: skip
    rows = []
    claimed = float("nan")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for x, y in rest_of_run(private.loader):
                private.optimizer.zero_grad()
                settings["criterion"](copied(x), y).backward()
                private.optimizer.step()
                grads = [p.grad.detach().reshape(-1) for p in copied.parameters()
                         if p.requires_grad and p.grad is not None]  # fmt: skip
                rows.append(torch.cat(grads).double().numpy() * private.plan.expected_batch_size)
                if len(rows) == 1 and noise_multiplier > _NOISE_FREE:
                    claimed = private.epsilon()
                if on_step is not None:
                    on_step()
                if len(rows) == steps:
                    break
    finally:
        private.engine.detach()
    return np.stack(rows), claimed


def _noise_free(model: nn.Module, base: Dataset, canary: Any, present: bool,
                settings: dict) -> np.ndarray:  # fmt: skip
    """The clipped sum S of one step without (to 10⁻⁹·σ) noise."""
    released, _ = _released(model, base, canary, present, 1, _NOISE_FREE, settings, 0)
    return released[0]


__all__ = [
    "CANARY_SCALE",
    "DEFAULT_RECORDS",
    "DEFAULT_STEPS",
    "audit_user_model",
    "input_canary",
]
