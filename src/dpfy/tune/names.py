"""The names ``dpfy tune`` offers, without importing torch: the CLI lists them as choices.

Each tuple equals its registry's keys (``SEARCHES`` in :mod:`dpfy.tune.config`,
``TUNING_METHODS`` in :mod:`dpfy.tune.cost`, the feature datasets in :mod:`dpfy.tune.datasets`);
a test keeps them equal.
"""

from __future__ import annotations

from dpfy.jobs.config import DATASET_NAMES
from dpfy.plan.accounting.events import TrialDistribution

SEARCH_NAMES = ("clip", "lr-clip", "random")
TUNING_METHOD_NAMES = ("compose", "exponential", "random-trials", "public")
DISTRIBUTION_NAMES = tuple(d.value for d in TrialDistribution)
#: Datasets of a public model's features (tuning a fine-tuning run's head), beside the bundled ones.
FEATURE_DATASET_NAMES = ("rotten-tomatoes",)
TUNING_DATASET_NAMES = (*DATASET_NAMES, *FEATURE_DATASET_NAMES)

__all__ = [
    "DISTRIBUTION_NAMES",
    "FEATURE_DATASET_NAMES",
    "SEARCH_NAMES",
    "TUNING_DATASET_NAMES",
    "TUNING_METHOD_NAMES",
]
