"""The UCI Adult loader: the user's files (none ship with any package), one-hot encoded over the
public UCI vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpfy.data import adult as _adult
from dpfy.data.loaded_dataset import (
    _STRATIFIED,
    DatasetNotFound,
    LoadedDataset,
    LoadOptions,
    _head,
    _scale_tabular,
    _split,
    _split_note,
    _tensors,
)
from dpfy.data.preprocessing import Preprocessing
from dpfy.data.public_ranges import ADULT_RANGES

# --------------------------------------------------------------------------- UCI Adult


def _adult_files(data_dir: Path | None) -> tuple[Path, Path | None]:
    """The training file and the optional test file for Adult, or :class:`DatasetNotFound`."""
    hint = (
        "adult has no bundled copy (no Debian or PyPI package ships it): pass --data-dir DIR "
        "(data_dir=DIR) holding the UCI files adult.data and adult.test, or --data-dir FILE "
        "pointing at a CSV with a header row including 'income'"
    )
    if data_dir is None:
        raise DatasetNotFound(f"{hint}.")
    if data_dir.is_file():
        return data_dir, None
    for train_name, test_name in (("adult.data", "adult.test"), ("adult.csv", None)):
        train = data_dir / train_name
        if train.is_file():
            test = data_dir / test_name if test_name else None
            return train, test if test is not None and test.is_file() else None
    raise DatasetNotFound(f"adult not found in {data_dir} (no adult.data or adult.csv); {hint}.")


def _read_adult(path: Path) -> _adult.AdultTable:
    """One Adult file, with unreadable or binary files refused by name (not a bare codec error)."""
    try:
        return _adult.read_adult(path)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"adult: {path} is not a UTF-8 text file (byte {err.start}: {err.reason}); pass the "
            "UCI text files adult.data/adult.test or a CSV"
        ) from None
    except OSError as err:
        raise ValueError(
            f"adult: cannot read {path} ({err.strerror or err}); check its permissions, or pass "
            "--data-dir pointing at a readable copy"
        ) from None


def _adult_rows(table: _adult.AdultTable, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Encoded features and labels of one Adult file, cut to ``limit``."""
    return _head(_adult.encode(table), limit), _head(table.labels, limit)


def _load_adult(options: LoadOptions) -> LoadedDataset:
    """Adult with public one-hot vocabulary; numeric columns scaled between public bounds."""
    train_file, test_file = _adult_files(options.data_dir)
    train = _read_adult(train_file)
    if test_file is None:
        parts = _split(_adult.encode(train), train.labels, options.limit, f"adult: {train_file}")
        x_train, x_test, y_train, y_test = parts
        split, source = _STRATIFIED, f"{train_file}"
    else:
        test = _read_adult(test_file)
        x_train, y_train = _adult_rows(train, options.limit)
        x_test, y_test = _adult_rows(test, options.limit)
        split = "the dataset's own split: adult.data for training, adult.test for test"
        source = f"{train_file}, {test_file}"
    numeric = slice(0, len(_adult.NUMERIC))
    x_train, x_test, scaling, fitted = _scale_tabular(
        x_train, x_test, numeric, options, ADULT_RANGES, "the census coding adult.names documents"
    )
    steps = (
        "one-hot categoricals over the public UCI attribute values (vocabulary not learned "
        "from the data; unknown or missing '?' values encode as all zeros)",
        *scaling,
    )
    shape = (x_train.shape[1],)
    return LoadedDataset(
        name="adult",
        train=_tensors(x_train, y_train, shape),
        test=_tensors(x_test, y_test, shape),
        num_classes=2,
        input_shape=shape,
        source=source,
        preprocessing=Preprocessing(steps, fitted, options.declare_public),
        split=_split_note(split, options.limit),
        class_names=_adult.CLASS_NAMES,
    )
