"""The data of a ``dpfy tune`` run: what the trials train and are scored on, what the final run
trains and is tested on, and which part is public when tuning is declared public."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfy.data.datasets import LoadedDataset
from dpfy.jobs.config import public_seed
from dpfy.tune.config import TuneConfig
from dpfy.tune.trial import TuningData, split_indices


def _take(data: TensorDataset, indices: np.ndarray) -> TensorDataset:
    """The rows ``indices`` of a tensor dataset, as a new tensor dataset."""
    index = torch.as_tensor(indices, dtype=torch.long)
    return TensorDataset(*(t[index] for t in data.tensors))


@dataclass(frozen=True)
class Splits:
    """Tuning train/validation, and the final run's (private) train and held-out test."""

    tuning: TuningData
    final: LoadedDataset
    public_size: int


def make_splits(data: LoadedDataset, config: TuneConfig, public: bool) -> Splits:
    """Validation = a seeded half of the test split; public tuning gets a disjoint train part."""
    validation_idx, test_idx = split_indices(len(data.test), 0.5, public_seed(config.seed))
    validation = _take(data.test, validation_idx)
    final_test = _take(data.test, test_idx)
    private_train, tuning_train, public_size = data.train, data.train, 0
    if public:
        public_idx, private_idx = split_indices(
            len(data.train), config.public_fraction, public_seed(config.seed) + 1
        )
        tuning_train = _take(data.train, public_idx)
        private_train = _take(data.train, private_idx)
        public_size = len(public_idx)
    tuning = TuningData(tuning_train, validation, data.input_shape, data.num_classes)
    final = replace(data, train=private_train, test=final_test)
    return Splits(tuning, final, public_size)


def resolved_delta(config: TuneConfig, size: int) -> float:
    """δ as given, or a power of ten at least 10× below 1/N (guide §2.1)."""
    if config.delta is not None:
        return config.delta
    return 10.0 ** -(math.ceil(math.log10(size)) + 1)


__all__ = ["Splits", "make_splits", "resolved_delta"]
