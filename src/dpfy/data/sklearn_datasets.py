"""The datasets scikit-learn bundles (digits, breast-cancer): offline, with the fixed stratified
split."""

from __future__ import annotations

from dpfy.data.loaded_dataset import (
    _STRATIFIED,
    LoadedDataset,
    LoadOptions,
    _scale_tabular,
    _split,
    _split_note,
    _tensors,
)
from dpfy.data.preprocessing import Preprocessing
from dpfy.data.public_ranges import BREAST_CANCER_RANGES

# --------------------------------------------------------------------------- scikit-learn


def _sklearn_source(loader: str) -> str:
    """Name the scikit-learn version and loader a bundled dataset came from."""
    import sklearn

    return f"scikit-learn {sklearn.__version__}: sklearn.datasets.{loader} (bundled, offline)"


def _load_digits(options: LoadOptions) -> LoadedDataset:
    """Digits scaled by the fixed constant 1/16 (pixel values are 0..16); nothing fitted."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x_train, x_test, y_train, y_test = _split(bunch.data / 16.0, bunch.target, options.limit)
    shape = (1, 8, 8)
    return LoadedDataset(
        name="digits",
        train=_tensors(x_train, y_train, shape),
        test=_tensors(x_test, y_test, shape),
        num_classes=10,
        input_shape=shape,
        source=_sklearn_source("load_digits"),
        preprocessing=Preprocessing(
            steps=("pixel / 16 (fixed constant: pixel values are 0..16)",),
            fitted_on_private_data=False,
            declared_public=options.declare_public,
        ),
        split=_split_note(_STRATIFIED, options.limit),
        class_names=tuple(str(d) for d in range(10)),
    )


def _load_breast_cancer(options: LoadOptions) -> LoadedDataset:
    """Tabular features log-scaled between the published per-feature ranges; nothing fitted."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    x_train, x_test, y_train, y_test = _split(bunch.data, bunch.target, options.limit)
    x_train, x_test, steps, fitted = _scale_tabular(
        x_train, x_test, slice(None), options, BREAST_CANCER_RANGES,
        "the min and max scikit-learn's dataset description publishes",
    )  # fmt: skip
    shape = (int(bunch.data.shape[1]),)
    return LoadedDataset(
        name="breast-cancer",
        train=_tensors(x_train, y_train, shape),
        test=_tensors(x_test, y_test, shape),
        num_classes=2,
        input_shape=shape,
        source=_sklearn_source("load_breast_cancer"),
        preprocessing=Preprocessing(tuple(steps), fitted, options.declare_public),
        split=_split_note(_STRATIFIED, options.limit),
        class_names=tuple(str(n) for n in bunch.target_names),
    )
