"""Data for private training: samplers that match the accounting, and a loader built on them.

Poisson sampling (q = B/N, empty batches included) is the default; shuffled and fixed-size batches
exist only as explicit options whose records say they are not Poisson (guide §4.3).
Real datasets (:mod:`dpfy.data.datasets`) load from installed packages or local files, never from
the network, and record whether their preprocessing looked at the private data (guide §5.5.1).
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports

#: Public names, loaded on first use (PEP 562): the sampling records and the ledger they feed
#: stay importable without torch, so a saved report re-renders where torch is not installed.
_EXPORTS = {
    "DatasetNotFound": "dpfy.data.datasets",
    "LoadedDataset": "dpfy.data.datasets",
    "available_datasets": "dpfy.data.datasets",
    "load_dataset": "dpfy.data.datasets",
    "IdxFormatError": "dpfy.data.idx",
    "read_idx": "dpfy.data.idx",
    "write_idx": "dpfy.data.idx",
    "DPDataLoader": "dpfy.data.loader",
    "EmptyBatchCollate": "dpfy.data.loader",
    "empty_batch_like": "dpfy.data.loader",
    "PlanComplete": "dpfy.data.loader",
    "rest_of_run": "dpfy.data.loader",
    "Padding": "dpfy.data.padding",
    "Preprocessing": "dpfy.data.preprocessing",
    "RandomSource": "dpfy.data.randomness",
    "SecureSource": "dpfy.data.randomness",
    "TorchSource": "dpfy.data.randomness",
    "SamplingKind": "dpfy.plan.sampling",
    "SamplingRecord": "dpfy.plan.sampling",
    "BallsInBinsSampler": "dpfy.data.sampling",
    "DpBatchSampler": "dpfy.data.sampling",
    "FixedSizeSampler": "dpfy.data.sampling",
    "PoissonSampler": "dpfy.data.sampling",
    "ShuffleSampler": "dpfy.data.sampling",
    "TruncatedPoissonSampler": "dpfy.data.sampling",
    "make_sampler": "dpfy.data.sampling",
    "sampling_rate_for": "dpfy.data.sampling",
}

__all__ = [
    "BallsInBinsSampler",
    "DPDataLoader",
    "DatasetNotFound",
    "DpBatchSampler",
    "EmptyBatchCollate",
    "FixedSizeSampler",
    "IdxFormatError",
    "LoadedDataset",
    "Padding",
    "PlanComplete",
    "PoissonSampler",
    "Preprocessing",
    "RandomSource",
    "SamplingKind",
    "SamplingRecord",
    "SecureSource",
    "ShuffleSampler",
    "TorchSource",
    "TruncatedPoissonSampler",
    "available_datasets",
    "empty_batch_like",
    "load_dataset",
    "make_sampler",
    "read_idx",
    "rest_of_run",
    "sampling_rate_for",
    "write_idx",
]


__getattr__ = lazy_exports(__name__, _EXPORTS)
