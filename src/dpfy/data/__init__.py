"""Data for private training: samplers that match the accounting, and a loader built on them.

Poisson sampling (q = B/N, empty batches included) is the default; shuffled and fixed-size batches
exist only as explicit options whose records say they are not Poisson (guide §4.3, DESIGN rule 4).
Real datasets (:mod:`dpfy.data.datasets`) load from installed packages or local files, never from
the network, and record whether their preprocessing looked at the private data (guide §5.5.1).
"""

from dpfy.data.datasets import (
    DatasetNotFound,
    LoadedDataset,
    available_datasets,
    load_dataset,
)
from dpfy.data.idx import IdxFormatError, read_idx, write_idx
from dpfy.data.loader import DPDataLoader, EmptyBatchCollate, empty_batch_like
from dpfy.data.preprocessing import Preprocessing
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
    "DatasetNotFound",
    "DpBatchSampler",
    "EmptyBatchCollate",
    "FixedSizeSampler",
    "IdxFormatError",
    "LoadedDataset",
    "PoissonSampler",
    "Preprocessing",
    "RandomSource",
    "SamplingKind",
    "SamplingRecord",
    "SecureSource",
    "ShuffleSampler",
    "TorchSource",
    "available_datasets",
    "empty_batch_like",
    "load_dataset",
    "make_sampler",
    "read_idx",
    "sampling_rate_for",
    "write_idx",
]
