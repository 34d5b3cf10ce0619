"""Data for private training: samplers that match the accounting, and a loader built on them.

Poisson sampling (q = B/N, empty batches included) is the default; shuffled and fixed-size batches
exist only as explicit options whose records say they are not Poisson (guide §4.3, DESIGN rule 4).
"""

from dpfy.data.loader import DPDataLoader, EmptyBatchCollate, empty_batch_like
from dpfy.data.randomness import RandomSource, SecureSource, TorchSource
from dpfy.data.records import SamplingKind, SamplingRecord
from dpfy.data.sampling import (
    DpBatchSampler,
    FixedSizeSampler,
    PoissonSampler,
    ShuffleSampler,
    make_sampler,
    sampling_rate_for,
)

__all__ = [
    "DPDataLoader",
    "DpBatchSampler",
    "EmptyBatchCollate",
    "FixedSizeSampler",
    "PoissonSampler",
    "RandomSource",
    "SamplingKind",
    "SamplingRecord",
    "SecureSource",
    "ShuffleSampler",
    "TorchSource",
    "empty_batch_like",
    "make_sampler",
    "sampling_rate_for",
]
