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
the published mean/std), so nothing is fitted on the private data. Tabular data is standardised
with mean/std fitted on the training split — that *is* fitting on private data and the record
says so; pass ``standardize=False`` to skip it, or ``declare_public=True`` to state that the
statistics are public (the report card then does not flag them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfy._validate import check_count
from dpfy.data import adult as _adult
from dpfy.data.idx import read_idx
from dpfy.data.preprocessing import Preprocessing, fit_standardizer

__all__ = [
    "SPLIT_SEED",
    "TEST_FRACTION",
    "DatasetNotFound",
    "DatasetSpec",
    "LoadOptions",
    "LoadedDataset",
    "available_datasets",
    "load_dataset",
    "register_dataset",
]

SPLIT_SEED = 0
TEST_FRACTION = 0.2
_FITTED_STEP = "standardise each numeric feature with mean/std fitted on the training split"


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
    return data


# --------------------------------------------------------------------------- shared helpers


def _tensors(features: np.ndarray, labels: np.ndarray, shape: tuple[int, ...]) -> TensorDataset:
    """Features as float32 of shape (N, *shape) and labels as int64, in one TensorDataset."""
    x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)).reshape(-1, *shape)
    y = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
    return TensorDataset(x, y)


def _head(array: np.ndarray, limit: int | None) -> np.ndarray:
    """The first ``limit`` rows (all of them without a limit)."""
    return array if limit is None else array[:limit]


def _split(
    features: np.ndarray, labels: np.ndarray, limit: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed stratified 80/20 split (seed :data:`SPLIT_SEED`), each part cut to ``limit``."""
    from sklearn.model_selection import train_test_split

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


def _sklearn_source(loader: str) -> str:
    """Name the scikit-learn version and loader a bundled dataset came from."""
    import sklearn

    return f"scikit-learn {sklearn.__version__}: sklearn.datasets.{loader} (bundled, offline)"


def _standardise_tabular(
    x_train: np.ndarray, x_test: np.ndarray, columns: slice, options: LoadOptions
) -> tuple[np.ndarray, np.ndarray, list[str], bool]:
    """Z-score ``columns`` with statistics fitted on the training split, if asked to."""
    if not options.standardize:
        return x_train, x_test, ["numeric features left unscaled (standardize=False)"], False
    scaler = fit_standardizer(x_train[:, columns])
    x_train, x_test = x_train.astype(np.float64), x_test.astype(np.float64)
    x_train[:, columns] = scaler(x_train[:, columns])
    x_test[:, columns] = scaler(x_test[:, columns])
    return x_train, x_test, [f"{_FITTED_STEP} (private data)"], True


# --------------------------------------------------------------------------- scikit-learn


@register_dataset("digits", "handwritten digits, 1797 8×8 images, 10 classes (scikit-learn)")
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


@register_dataset("breast-cancer", "Wisconsin breast cancer, 569 rows, 30 features, 2 classes")
def _load_breast_cancer(options: LoadOptions) -> LoadedDataset:
    """Tabular features, standardised on the training split unless told otherwise."""
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    x_train, x_test, y_train, y_test = _split(bunch.data, bunch.target, options.limit)
    x_train, x_test, steps, fitted = _standardise_tabular(x_train, x_test, slice(None), options)
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


# --------------------------------------------------------------------------- IDX images


@dataclass(frozen=True)
class _IdxDataset:
    """Where an MNIST-style dataset lives and its published normalisation constants."""

    name: str
    default_dirs: tuple[Path, ...]
    package: str | None
    provider: str
    mean: float
    std: float
    class_names: tuple[str, ...]


_IDX_FILES = {
    "train_images": ("train", "images", "idx3"),
    "train_labels": ("train", "labels", "idx1"),
    "test_images": ("t10k", "images", "idx3"),
    "test_labels": ("t10k", "labels", "idx1"),
}


def _idx_candidates(directory: Path, prefix: str, kind: str, idx: str) -> list[Path]:
    """Standard spellings of one IDX file: ``-`` or ``.`` before ``idxN``, gzip or not."""
    stems = (f"{prefix}-{kind}-{idx}-ubyte", f"{prefix}-{kind}.{idx}-ubyte")
    return [directory / f"{stem}{ext}" for stem in stems for ext in (".gz", "")]


def _find_idx(directory: Path) -> tuple[dict[str, Path], list[str]]:
    """The four IDX files found in ``directory`` and the standard names of those missing."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    for key, parts in _IDX_FILES.items():
        hit = next((p for p in _idx_candidates(directory, *parts) if p.is_file()), None)
        if hit is None:
            missing.append(_idx_candidates(directory, *parts)[0].name)
        else:
            found[key] = hit
    return found, missing


def _locate_idx(spec: _IdxDataset, data_dir: Path | None) -> tuple[Path, dict[str, Path]]:
    """The first directory holding all four files, or :class:`DatasetNotFound` saying why."""
    directories = (data_dir,) if data_dir is not None else spec.default_dirs
    report = []
    for directory in directories:
        found, missing = _find_idx(directory)
        if not missing:
            return directory, found
        absent = (
            "no IDX files" if len(missing) == len(_IDX_FILES) else "missing " + ", ".join(missing)
        )
        report.append(f"{directory} ({absent})")
    wanted = ", ".join(_idx_candidates(Path(), *parts)[0].name for parts in _IDX_FILES.values())
    raise DatasetNotFound(
        f"{spec.name} not found in {'; '.join(report)}. {spec.provider}, or pass --data-dir DIR "
        f"(data_dir=DIR) holding {wanted} (gzip optional)."
    )


def _read_split(
    files: dict[str, Path], split: str, limit: int | None, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Read one split's images and labels and check they fit together."""
    images = read_idx(files[f"{split}_images"], limit=limit)
    labels = read_idx(files[f"{split}_labels"], limit=limit)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.ndim != 1:
        raise ValueError(
            f"{name}: expected 28×28 images and 1-D labels, got {images.shape} and {labels.shape}"
        )
    if len(images) != len(labels):
        raise ValueError(
            f"{name}: {len(images)} images but {len(labels)} labels "
            f"({files[f'{split}_labels']}); restore an intact copy of the files"
        )
    _check_labels(labels, 10, files[f"{split}_labels"], name)
    return images, labels


def _check_labels(labels: np.ndarray, classes: int, path: Path, name: str) -> None:
    """Every label must be a class 0..classes−1: a −1 or NaN would train on garbage silently."""
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(labels) & (labels >= 0) & (labels < classes) & (labels % 1 == 0)
    bad = np.flatnonzero(~valid)
    if bad.size:
        raise ValueError(
            f"{name}: {path} holds {bad.size} label(s) outside the classes 0..{classes - 1} "
            f"(the first, at row {bad[0]}: {labels[bad[0]].item()!r}; a label above "
            f"{classes - 1}, below 0 or not a whole number); restore an intact copy of the file"
        )


def _idx_source(spec: _IdxDataset, directory: Path) -> str:
    """Name the directory, and the Debian package when the files came from its location."""
    if spec.package and directory in spec.default_dirs:
        return f"IDX files in {directory} (Debian package {spec.package})"
    return f"IDX files in {directory}"


def _load_idx(spec: _IdxDataset, options: LoadOptions) -> LoadedDataset:
    """Load an MNIST-style dataset, scaled by public constants only."""
    directory, files = _locate_idx(spec, options.data_dir)
    steps = ["pixel / 255 (fixed constant)"]
    if options.standardize:
        steps.append(
            f"(x - {spec.mean:.4f}) / {spec.std:.4f}: the published {spec.name} mean/std "
            "constants, not fitted in this run"
        )
    mean, std = (spec.mean, spec.std) if options.standardize else (0.0, 1.0)
    parts = {}
    for split in ("train", "test"):
        images, labels = _read_split(files, split, options.limit, spec.name)
        pixels = (images.astype(np.float32) / np.float32(255) - np.float32(mean)) / np.float32(std)
        parts[split] = _tensors(pixels, labels, (1, 28, 28))
    return LoadedDataset(
        name=spec.name,
        train=parts["train"],
        test=parts["test"],
        num_classes=10,
        input_shape=(1, 28, 28),
        source=_idx_source(spec, directory),
        preprocessing=Preprocessing(tuple(steps), False, options.declare_public),
        split=_split_note(
            "the dataset's own split: train-* for training, t10k-* for test", options.limit
        ),
        class_names=spec.class_names,
    )


_FASHION = _IdxDataset(
    name="fashion-mnist",
    default_dirs=(Path("/usr/share/datasets/fashion-mnist"),),
    package="dataset-fashion-mnist",
    provider="Install it with `apt-get install dataset-fashion-mnist` (Debian package)",
    mean=0.2860,
    std=0.3530,
    class_names=(
        "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
        "Bag", "Ankle boot",
    ),
)  # fmt: skip
_MNIST = _IdxDataset(
    name="mnist",
    default_dirs=(Path("/usr/share/datasets/mnist"),),
    package=None,
    provider="No Debian package ships MNIST: place the IDX files in /usr/share/datasets/mnist",
    mean=0.1307,
    std=0.3081,
    class_names=tuple(str(d) for d in range(10)),
)


@register_dataset("fashion-mnist", "Zalando Fashion-MNIST, 70000 28×28 images, 10 classes (IDX)")
def _load_fashion_mnist(options: LoadOptions) -> LoadedDataset:
    """Fashion-MNIST from Debian's dataset-fashion-mnist or ``data_dir``."""
    return _load_idx(_FASHION, options)


@register_dataset("mnist", "MNIST handwritten digits, 70000 28×28 images, 10 classes (IDX)")
def _load_mnist(options: LoadOptions) -> LoadedDataset:
    """MNIST from ``data_dir`` (or /usr/share/datasets/mnist)."""
    return _load_idx(_MNIST, options)


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


@register_dataset("adult", "UCI Adult census income (>50K?), 2 classes; needs data_dir")
def _load_adult(options: LoadOptions) -> LoadedDataset:
    """Adult with public one-hot vocabulary; numeric columns standardised unless told otherwise."""
    train_file, test_file = _adult_files(options.data_dir)
    train = _read_adult(train_file)
    if test_file is None:
        parts = _split(_adult.encode(train), train.labels, options.limit)
        x_train, x_test, y_train, y_test = parts
        split, source = _STRATIFIED, f"{train_file}"
    else:
        test = _read_adult(test_file)
        x_train, y_train = _adult_rows(train, options.limit)
        x_test, y_test = _adult_rows(test, options.limit)
        split = "the dataset's own split: adult.data for training, adult.test for test"
        source = f"{train_file}, {test_file}"
    numeric = slice(0, len(_adult.NUMERIC))
    x_train, x_test, scaling, fitted = _standardise_tabular(x_train, x_test, numeric, options)
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
