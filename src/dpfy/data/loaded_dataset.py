"""What every dataset loader returns (LoadedDataset) and is given (LoadOptions), and the steps
loaders share, so each split and scaling is recorded the same way (guide §5.5.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfy.data.preprocessing import Preprocessing, PublicRangeScaler

__all__ = [
    "SPLIT_SEED",
    "TEST_FRACTION",
    "DatasetNotFound",
    "LoadOptions",
    "LoadedDataset",
    "refuse_non_finite",
]

SPLIT_SEED = 0
TEST_FRACTION = 0.2
_RANGE_STEP = (
    "numeric features log-scaled into [-1, 1] between fixed public bounds per feature ({source}; "
    "nothing computed from the data)"
)


class DatasetNotFound(ValueError):
    """The dataset's files are not on this machine; the message says what provides them."""


@dataclass(frozen=True)
class LoadOptions:
    """What the caller asked for: where to look, how many examples, which scaling."""

    data_dir: Path | None = None
    limit: int | None = None
    standardize: bool = True
    declare_public: bool = False


@dataclass(frozen=True)
class LoadedDataset:
    """A dataset ready for training, with the facts a privacy report needs about it."""

    name: str
    train: TensorDataset
    test: TensorDataset
    num_classes: int
    input_shape: tuple[int, ...]
    source: str
    preprocessing: Preprocessing
    split: str
    class_names: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (no tensors) for the report."""
        return {
            "name": self.name,
            "source": self.source,
            "train_size": len(self.train),
            "test_size": len(self.test),
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            "split": self.split,
            "preprocessing": self.preprocessing.to_dict(),
        }


# --------------------------------------------------------------------------- shared helpers


def refuse_non_finite(
    features: np.ndarray | torch.Tensor,
    where: str,
    columns: tuple[str, ...] | None = None,
    *,
    first_row: int = 1,
) -> None:
    """Refuse NaN or ±inf features, naming ``where`` (the file), the row and the column.

    A non-finite feature gives a NaN logit, which ``argmax`` counts as class 0 and the loss turns
    into a NaN gradient: accuracy would be printed for garbage, and a DP-SGD step would fail or
    pass by sampling luck. So it is refused at load, before anything trains. Rows count from
    ``first_row`` (1: the first data row); columns are named by ``columns`` or numbered from 0.
    """
    array = features.numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
    if array.dtype.kind not in "fc" or array.size == 0:
        return
    flat = array.reshape(len(array), -1)
    bad = ~np.isfinite(flat)
    if not bad.any():
        return
    row, column = (int(i) for i in np.argwhere(bad)[0])
    name = columns[column] if columns is not None and column < len(columns) else str(column)
    count = int(bad.sum())
    more = "" if count == 1 else f" ({count} non-finite values in all)"
    raise ValueError(
        f"{where}: row {row + first_row}, column {name} holds {float(flat[row, column])!r}, not a "
        f"finite number{more}; remove or impute those values before training (a NaN or "
        "infinite feature makes NaN predictions and gradients)"
    )


def _tensors(features: np.ndarray, labels: np.ndarray, shape: tuple[int, ...]) -> TensorDataset:
    """Features as float32 of shape (N, *shape) and labels as int64, in one TensorDataset."""
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)).reshape(-1, *shape)
    y = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
    return TensorDataset(x, y)


def _head(array: np.ndarray, limit: int | None) -> np.ndarray:
    """The first ``limit`` rows (all of them without a limit)."""
    return array if limit is None else array[:limit]


def _check_splittable(labels: np.ndarray, where: str) -> None:
    """Refuse, naming the fix, rows too few for the stratified split (instead of scikit-learn's
    own message about ``test_size`` or ``n_splits``)."""
    classes, counts = np.unique(labels, return_counts=True)
    rows = len(labels)
    test = math.ceil(TEST_FRACTION * rows)
    if rows and counts.min() >= 2 and len(classes) <= test <= rows - len(classes):
        return
    found = ", ".join(f"{n} of class {c}" for c, n in zip(classes, counts, strict=True)) or "none"
    need = max(2 * max(len(classes), 2), math.ceil(max(len(classes), 2) / TEST_FRACTION))
    raise ValueError(
        f"{where}: {rows} data rows ({found}) are too few for the stratified "
        f"{1 - TEST_FRACTION:.0%}/{TEST_FRACTION:.0%} train/test split, which needs at least 2 "
        f"rows of each class and a test part holding every class; supply at least {need} rows "
        "with every class at least twice, or a separate test file"
    )


def _split(
    features: np.ndarray, labels: np.ndarray, limit: int | None, where: str = "the dataset"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed stratified 80/20 split (seed :data:`SPLIT_SEED`), each part cut to ``limit``."""
    from sklearn.model_selection import train_test_split

    _check_splittable(labels, where)

    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=TEST_FRACTION, stratify=labels, random_state=SPLIT_SEED
    )
    return _head(x_train, limit), _head(x_test, limit), _head(y_train, limit), _head(y_test, limit)


def _split_note(base: str, limit: int | None) -> str:
    """Describe the split, mentioning the limit when one was applied."""
    return base if limit is None else f"{base}; first {limit} examples of each split kept"


_STRATIFIED = (
    f"stratified {1 - TEST_FRACTION:.0%}/{TEST_FRACTION:.0%} train/test split, "
    f"seed {SPLIT_SEED} (sklearn train_test_split)"
)


def _scale_tabular(
    x_train: np.ndarray,
    x_test: np.ndarray,
    columns: slice,
    options: LoadOptions,
    ranges: tuple[tuple[float, float], ...],
    source: str,
) -> tuple[np.ndarray, np.ndarray, list[str], bool]:
    """Scale ``columns`` between the published ``ranges``, if asked to; nothing is fitted.

    Returns both splits, the step's description and ``False``: no statistic of the private
    training split is computed, so the report has no fitted preprocessing to flag.
    """
    if not options.standardize:
        return x_train, x_test, ["numeric features left unscaled (standardize=False)"], False
    scaler = PublicRangeScaler.from_ranges(ranges)
    x_train, x_test = x_train.astype(np.float64), x_test.astype(np.float64)
    x_train[:, columns] = scaler(x_train[:, columns])
    x_test[:, columns] = scaler(x_test[:, columns])
    return x_train, x_test, [_RANGE_STEP.format(source=source)], False
