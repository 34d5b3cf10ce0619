"""Tuning under privacy (guide §5.4): ClipSearch, lr × C sweeps, the σC/B planner, tuning cost.

Searches propose configurations fixed before any data is seen; the :class:`Tuner` runs them as
short DP-SGD trials, selects one, and accounts the tuning in the ledger by a method chosen from
:data:`TUNING_METHODS` (compose, exponential, random-trials, public). Importing this package is
light: the torch-based modules load on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from dpfy.tuning.cost import TUNING_METHODS, TuningAccounting, TuningSpec, get_method
from dpfy.tuning.planner import (
    RatioAssumptionWarning,
    RatioPlan,
    noise_to_batch_ratio,
    plan_at_fixed_ratio,
)

_LAZY = {
    "ClipSearch": "dpfy.tuning.clip_search",
    "choose_clip": "dpfy.tuning.clip_search",
    "LrClipSweep": "dpfy.tuning.sweep",
    "RandomSearch": "dpfy.tuning.random_search",
    "TrialConfig": "dpfy.tuning.trial",
    "TuningData": "dpfy.tuning.trial",
    "run_trial": "dpfy.tuning.trial",
    "Tuner": "dpfy.tuning.tuner",
    "TuningOutcome": "dpfy.tuning.tuner",
    "TuneConfig": "dpfy.tuning.pipeline",
    "run_tuning": "dpfy.tuning.pipeline",
}


def __getattr__(name: str) -> Any:
    """Load the torch-based parts on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dpfy.tuning' has no attribute {name!r}")


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
