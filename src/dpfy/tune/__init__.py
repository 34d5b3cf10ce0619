"""Tuning under privacy (guide §5.4): ClipSearch, lr × C sweeps, the σC/B planner, tuning cost.

Searches propose configurations fixed before any data is seen; the :class:`Tuner` runs them as
short DP-SGD trials, selects one, and accounts the tuning in the ledger by a method chosen from
:data:`TUNING_METHODS` (compose, exponential, random-trials, public). Importing this package is
light: the torch-based modules load on first use of their names.
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports
from dpfy.tune.cost import TUNING_METHODS, TuningAccounting, TuningSpec, get_method
from dpfy.tune.planner import (
    RatioAssumptionWarning,
    RatioPlan,
    noise_to_batch_ratio,
    plan_at_fixed_ratio,
)

_LAZY = {
    "ClipSearch": "dpfy.tune.clip_search",
    "choose_clip": "dpfy.tune.clip_search",
    "LrClipSweep": "dpfy.tune.sweep",
    "RandomSearch": "dpfy.tune.random_search",
    "TrialConfig": "dpfy.tune.trial",
    "TuningData": "dpfy.tune.trial",
    "run_trial": "dpfy.tune.trial",
    "Tuner": "dpfy.tune.tuner",
    "TuningOutcome": "dpfy.tune.tuner",
    "TuneConfig": "dpfy.tune.config",
    "plan_budget": "dpfy.tune.budget",
    "run_tuning": "dpfy.tune.pipeline",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "TUNING_METHODS",
    "RatioAssumptionWarning",
    "RatioPlan",
    "TuningAccounting",
    "TuningSpec",
    "get_method",
    "noise_to_batch_ratio",
    "plan_at_fixed_ratio",
    *_LAZY,
]
