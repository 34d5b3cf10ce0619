"""MNIST-style datasets from local IDX files (fashion-mnist, mnist), scaled by published constants
only, so nothing is fitted on the private data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpfy.data.idx import read_idx
from dpfy.data.loaded_dataset import (
    DatasetNotFound,
    LoadedDataset,
    LoadOptions,
    _split_note,
    _tensors,
    refuse_non_finite,
)
from dpfy.data.preprocessing import Preprocessing

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
    refuse_non_finite(images, f"{name}: {files[f'{split}_images']}", first_row=0)
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


def _load_fashion_mnist(options: LoadOptions) -> LoadedDataset:
    """Fashion-MNIST from Debian's dataset-fashion-mnist or ``data_dir``."""
    return _load_idx(_FASHION, options)


def _load_mnist(options: LoadOptions) -> LoadedDataset:
    """MNIST from ``data_dir`` (or /usr/share/datasets/mnist)."""
    return _load_idx(_MNIST, options)
