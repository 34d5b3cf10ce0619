"""The names ``dpfy tune`` offers, without importing torch: the CLI lists them as choices.

Each tuple equals its registry's keys (``SEARCHES`` in :mod:`dpfy.tune.config`,
``TUNING_METHODS`` in :mod:`dpfy.tune.cost`); a test keeps them equal.
"""

from __future__ import annotations

from dpfy.plan.accounting.events import TrialDistribution

SEARCH_NAMES = ("clip", "lr-clip", "random")
TUNING_METHOD_NAMES = ("compose", "exponential", "random-trials", "public")
DISTRIBUTION_NAMES = tuple(d.value for d in TrialDistribution)

__all__ = ["DISTRIBUTION_NAMES", "SEARCH_NAMES", "TUNING_METHOD_NAMES"]
