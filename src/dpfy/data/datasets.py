"""Real datasets for private training, from installed packages or local files — never downloaded.

``load_dataset(name, ...)`` looks the name up in a registry (``@register_dataset``) and returns one
frozen :class:`LoadedDataset`: train and test ``TensorDataset`` s (float32 features, int64 labels),
the input shape, where the data came from and a :class:`~dpfy.data.preprocessing.Preprocessing`
record saying whether any statistic was fitted on the private training split (guide §5.5.1).

=================  ======================================================  =================
name               source                                                  input shape
=================  ======================================================  =================
``digits``         scikit-learn ``load_digits`` (bundled; 1797 8×8 images)  (1, 8, 8)
``breast-cancer``  scikit-learn ``load_breast_cancer`` (569 rows, 2 classes) (30,)
``fashion-mnist``  IDX files: Debian ``dataset-fashion-mnist`` or data_dir   (1, 28, 28)
``mnist``          IDX files in data_dir (no Debian package ships MNIST)    (1, 28, 28)
``adult``          UCI Adult files or a CSV given by data_dir               (105,)
=================  ======================================================  =================

Splits: the scikit-learn datasets (and an Adult file without its own test file) use a fixed
stratified 80/20 train/test split (``train_test_split(test_size=0.2, stratify=y,
random_state=0)``), identical on every run; the IDX datasets and ``adult.data``/``adult.test``
keep their own split. ``limit`` keeps the first ``limit`` examples of each split (fast tests).

Scaling: images use fixed public constants only (digits: pixel/16; MNIST-style: pixel/255, then
the published mean/std), so nothing is fitted on the private data. Tabular numeric features are
log-scaled into [-1, 1] between fixed public per-feature bounds (:mod:`dpfy.data.public_ranges`:
the ranges breast-cancer's description publishes, the census coding of Adult), so nothing is
fitted there either; ``standardize=False`` leaves them unscaled. ``declare_public=True`` records
that any statistics fitted are public (the report card then does not flag them).

Where each part lives: LoadedDataset, LoadOptions and the shared split/scaling steps in
:mod:`dpfy.data.loaded_dataset`; the loaders in sklearn_datasets, idx_datasets and
adult_dataset; this module holds the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpfy._validate import check_count
from dpfy.data.adult_dataset import _load_adult
from dpfy.data.idx_datasets import _load_fashion_mnist, _load_mnist
from dpfy.data.loaded_dataset import (
    DatasetNotFound,
    LoadedDataset,
    LoadOptions,
    refuse_non_finite,
)
from dpfy.data.sklearn_datasets import _load_breast_cancer, _load_digits

__all__ = [
    "DatasetNotFound",
    "DatasetSpec",
    "LoadOptions",
    "LoadedDataset",
    "available_datasets",
    "load_dataset",
    "register_dataset",
]


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset: its name, a one-line description and its loader."""

    name: str
    description: str
    load: Callable[[LoadOptions], LoadedDataset]


_REGISTRY: dict[str, DatasetSpec] = {}


def register_dataset(
    name: str, description: str
) -> Callable[[Callable[[LoadOptions], LoadedDataset]], Callable[[LoadOptions], LoadedDataset]]:
    """Register a loader under ``name`` (one registry, no if/elif dispatch)."""

    def decorate(
        load: Callable[[LoadOptions], LoadedDataset],
    ) -> Callable[[LoadOptions], LoadedDataset]:
        if name in _REGISTRY:
            raise ValueError(f"dataset {name!r} is already registered")
        _REGISTRY[name] = DatasetSpec(name=name, description=description, load=load)
        return load

    return decorate


def available_datasets() -> dict[str, str]:
    """Registered dataset names with their one-line descriptions."""
    return {name: spec.description for name, spec in sorted(_REGISTRY.items())}


def load_dataset(
    name: str,
    *,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    standardize: bool = True,
    declare_public: bool = False,
) -> LoadedDataset:
    """Load a registered dataset (see the module docstring for sources, splits and scaling).

    ``data_dir`` is where to look for file-based datasets (for ``adult`` it may be the CSV file
    itself); ``limit`` keeps at most that many examples of each split. ``standardize=False``
    keeps only fixed, data-independent scaling (no effect on ``digits``, which has nothing
    else); ``declare_public=True`` records that fitted statistics are public (see
    :class:`~dpfy.data.preprocessing.Preprocessing`).
    """
    spec = _REGISTRY.get(name)
    if spec is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown dataset {name!r}; available: {known}")
    if limit is not None:
        limit = check_count("limit", limit, minimum=1)
    options = LoadOptions(
        data_dir=None if data_dir is None else Path(data_dir).expanduser(),
        limit=limit,
        standardize=bool(standardize),
        declare_public=bool(declare_public),
    )
    data = spec.load(options)
    for split, part in (("training", data.train), ("test", data.test)):
        if len(part) == 0:  # nothing to train on, or accuracy would be 0/0
            raise ValueError(
                f"{name}: the {split} split holds no examples ({data.source}); supply files "
                f"whose {split} split has examples"
            )
        # Every loader path (train, the access models, federated, tuning) passes here: a NaN
        # feature is refused by name whatever the loader did before.
        refuse_non_finite(part.tensors[0], f"{name} {split} split (from {data.source})")
    return data


# --------------------------------------------------------------------------- bundled loaders


register_dataset("digits", "handwritten digits, 1797 8×8 images, 10 classes (scikit-learn)")(
    _load_digits
)
register_dataset("breast-cancer", "Wisconsin breast cancer, 569 rows, 30 features, 2 classes")(
    _load_breast_cancer
)
register_dataset("fashion-mnist", "Zalando Fashion-MNIST, 70000 28×28 images, 10 classes (IDX)")(
    _load_fashion_mnist
)
register_dataset("mnist", "MNIST handwritten digits, 70000 28×28 images, 10 classes (IDX)")(
    _load_mnist
)
register_dataset("adult", "UCI Adult census income (>50K?), 2 classes; needs data_dir")(_load_adult)
