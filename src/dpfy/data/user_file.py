"""The user's own data from one file (``dpfy train --data FILE --label COLUMN``): CSV, NPZ or
Parquet, with the label named, or a folder of class subfolders of images (the label is the
subfolder), and the features' scale declared before any row is read.

Why declared: a scale fitted on the rows a run trains on (a mean, a standard deviation, a min and
max) is a statistic of the private data released outside the DP guarantee (guide §5.5.1, tab. 5).
So the features' scale is one of:

- ``LOW:HIGH``: one public range for every feature (e.g. ``0:255`` for pixels);
- ``FILE.json``: one public ``[low, high]`` per feature column (``{"age": [17, 90], …}``);
- ``as-is``: the features are already on a public, data-independent scale and are used unchanged;
- ``fit``: standardise with the training rows' mean and standard deviation — allowed, and the
  report card flags it as preprocessing fitted on the private data.

With bounds, each value is clipped to its range (which depends on no other row) and mapped
linearly into [-1, 1]. Nothing else is computed from the data except the label classes: the
distinct values of the label column, which the card counts (never lists: a value only one person
has would name them) as taken to be the task's public classes. A bad file is refused with one
line naming the row and column and the fix.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpfy.data.loaded_dataset import LoadedDataset, _tensors
from dpfy.data.preprocessing import Preprocessing, fit_standardizer

__all__ = [
    "FEATURE_BOUNDS_HELP",
    "FileData",
    "ScaleDeclaration",
    "load_user_file",
    "model_for_shape",
    "parse_feature_bounds",
    "peek_input_shape",
]

#: What ``--feature-bounds`` accepts, for help texts and refusals.
FEATURE_BOUNDS_HELP = (
    "LOW:HIGH (one public range for every feature, e.g. 0:255), FILE.json ({column: [low, "
    "high]} for each feature column), as-is (already on a public scale: used unchanged), or fit "
    "(standardise on the training rows: the report flags it as fitted on the private data)"
)
_SUFFIXES = (".csv", ".npz", ".parquet")
_NPZ_FEATURE_KEYS = ("x", "X", "features", "inputs")
_TEST_FRACTION = 0.2
_SPLIT_SEED = 0


@dataclass(frozen=True)
class ScaleDeclaration:
    """How the features are scaled: ``bounds`` (public), ``as-is``, or ``fit`` (the pitfall).

    ``ranges`` holds one (low, high) for all features (key ``"*"``) or one per column name.
    """

    kind: str
    ranges: dict[str, tuple[float, float]]
    given: str

    def describe(self) -> str:
        """The preprocessing step as the card states it."""
        if self.kind == "as-is":
            return (
                "features used as given (declared by the user to be on a public, "
                "data-independent scale: --feature-bounds as-is)"
            )
        if self.kind == "fit":
            return "features standardised with the training rows' mean and standard deviation"
        shown = (
            f"{self.ranges['*'][0]:g}..{self.ranges['*'][1]:g} for every feature"
            if "*" in self.ranges
            else f"one range per column from {self.given}"
        )
        return (
            f"features clipped to bounds declared public by the user ({shown}) and scaled "
            "linearly into [-1, 1], nothing computed from the data"
        )


def _range(text: str, where: str) -> tuple[float, float]:
    """One ``(low, high)`` with finite low < high."""
    try:
        low, high = (float(part) for part in text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected two numbers [low, high], got {text!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{where}: need finite low < high, got [{low:g}, {high:g}]")
    return low, high


def parse_feature_bounds(spec: str | None) -> ScaleDeclaration:
    """Read ``--feature-bounds``; refuse a missing one with the choices (nothing is guessed)."""
    if spec is None or not spec.strip():
        raise ValueError(
            "--data needs --feature-bounds: a scale fitted on the private rows would be released "
            f"outside the guarantee; pass {FEATURE_BOUNDS_HELP}"
        )
    spec = spec.strip()
    if spec in ("as-is", "fit"):
        return ScaleDeclaration(spec, {}, spec)
    if spec.lower().endswith(".json"):
        return ScaleDeclaration("bounds", _bounds_file(Path(spec)), spec)
    parts = spec.split(":")
    if len(parts) != 2:
        raise ValueError(f"--feature-bounds {spec!r} is not understood; pass {FEATURE_BOUNDS_HELP}")
    return ScaleDeclaration("bounds", {"*": _range(parts, f"--feature-bounds {spec}")}, spec)


def _bounds_file(path: Path) -> dict[str, tuple[float, float]]:
    """A JSON object {column: [low, high]}; one error naming the file and the entry if not."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--feature-bounds {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--feature-bounds {path} is not a readable JSON file ({err})") from None
    if not isinstance(document, dict) or not document:
        raise ValueError(
            f"--feature-bounds {path} must hold a JSON object {{column: [low, high], …}}"
        )
    return {
        str(name): _range(value if isinstance(value, list) else [value], f"{path}: {name!r}")
        for name, value in document.items()
    }


@dataclass(frozen=True)
class FileData:
    """Rows read from a file: features (N, *shape), label values, and the feature names."""

    features: np.ndarray
    labels: np.ndarray
    columns: tuple[str, ...]
    kind: str


def _suffix(path: Path) -> str:
    """The file's format, or one error naming the formats dpfy reads."""
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(
            f"--data {path}: unknown format {suffix or '(no suffix)'!r}; pass a .csv (header "
            "row, numeric features), .npz (a feature array and a label array) or .parquet file"
        )
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    return suffix


def _number(text: str, row: int, column: str, path: Path) -> float:
    """One CSV cell as a finite number, or one error naming its row and column."""
    try:
        value = float(text)
    except ValueError:
        shown = "an empty cell" if not text.strip() else f"{text!r}"
        raise ValueError(
            f"{path}: row {row}, column {column!r}: {shown} is not a number; encode categorical "
            "columns as numbers (e.g. one-hot) and fill or drop missing values before training"
        ) from None
    if not math.isfinite(value):
        raise ValueError(
            f"{path}: row {row}, column {column!r}: {text!r} is not a finite number; fill or "
            "drop missing values before training"
        )
    return value


def _read_csv(path: Path, label: str) -> FileData:
    """A CSV with a header row; row numbers count lines of the file (the header is row 1)."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not a UTF-8 text file (byte {err.start}); pass a CSV"
        ) from None
    if not rows:
        raise ValueError(f"{path} is empty; pass a CSV with a header row and data rows")
    header = [name.strip() for name in rows[0]]
    if label not in header:
        raise ValueError(
            f"{path}: no column {label!r} for --label; the header has {', '.join(header)}"
        )
    at = header.index(label)
    columns = tuple(name for i, name in enumerate(header) if i != at)
    if not columns:
        raise ValueError(f"{path}: only the label column {label!r}; there are no features")
    features, labels = [], []
    for line, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise ValueError(
                f"{path}: row {line} has {len(row)} cells, the header {len(header)}; every row "
                "needs one cell per column"
            )
        labels.append(row[at].strip())
        cells = (cell for i, cell in enumerate(row) if i != at)
        features.append(
            [_number(c, line, name, path) for c, name in zip(cells, columns, strict=True)]
        )
    if not labels:
        raise ValueError(f"{path}: a header but no data rows")
    if any(not value for value in labels):
        line = 2 + labels.index("")
        raise ValueError(f"{path}: row {line}, column {label!r}: the label is empty")
    return FileData(np.asarray(features, dtype=np.float64), np.asarray(labels), columns, "CSV")


def _read_npz(path: Path, label: str) -> FileData:
    """An NPZ: the label array named by ``label``, the features the only other array (or x)."""
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable .npz file ({err})") from None
    with archive:
        names = list(archive.files)
        if label not in names:
            raise ValueError(f"{path}: no array {label!r} for --label; it holds {', '.join(names)}")
        others = [name for name in names if name != label]
        named = [name for name in _NPZ_FEATURE_KEYS if name in others]
        if len(others) != 1 and not named:
            raise ValueError(
                f"{path}: cannot tell which array holds the features ({', '.join(others)}); "
                f"keep one feature array besides {label!r}, or name it x"
            )
        key = others[0] if len(others) == 1 else named[0]
        features, labels = archive[key], archive[label]
    if labels.ndim != 1 or features.ndim < 2 or len(features) != len(labels):
        raise ValueError(
            f"{path}: features {key!r} of shape {features.shape} and labels {label!r} of shape "
            f"{labels.shape} do not pair up; need features (N, …) and labels (N,)"
        )
    if not np.issubdtype(features.dtype, np.number) or features.dtype == np.bool_:
        raise ValueError(f"{path}: features {key!r} are {features.dtype}, not numbers")
    features = features.astype(np.float64)
    flat_view = features.reshape(len(features), -1)
    bad = np.argwhere(~np.isfinite(flat_view))
    if bad.size:
        row, column = (int(v) for v in bad[0])
        raise ValueError(
            f"{path}: row {row}, feature {column} of {key!r} is {flat_view[row, column]}, not a "
            "finite number; fill or drop missing values before training"
        )
    flat = features.shape[1] if features.ndim == 2 else 0
    columns = tuple(f"{key}[{i}]" for i in range(flat))
    return FileData(features, labels.astype(str), columns, "NPZ")


def _read_parquet(path: Path, label: str) -> FileData:
    """A Parquet table through pyarrow, when it is installed (dpfy does not depend on it)."""
    try:
        import pyarrow.parquet as parquet  # type: ignore[import-not-found]
    except ImportError:
        raise ValueError(
            f"--data {path}: reading Parquet needs pyarrow, which is not installed; `pip install "
            "pyarrow`, or save the table as CSV or NPZ"
        ) from None
    table = parquet.read_table(path)
    header = list(table.column_names)
    if label not in header:
        raise ValueError(
            f"{path}: no column {label!r} for --label; the table has {', '.join(header)}"
        )
    columns = tuple(name for name in header if name != label)
    features = []
    for name in columns:
        try:
            values = np.asarray(table.column(name).to_numpy(zero_copy_only=False), dtype=float)
        except (TypeError, ValueError):
            raise ValueError(
                f"{path}: column {name!r} is not numeric; encode it as numbers first"
            ) from None
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise ValueError(
                f"{path}: row {int(bad[0])}, column {name!r} is missing or not finite; fill or "
                "drop missing values before training"
            )
        features.append(values)
    labels = np.asarray(table.column(label).to_pylist()).astype(str)
    return FileData(np.stack(features, axis=1), labels, columns, "Parquet")


_READERS = {".csv": _read_csv, ".npz": _read_npz, ".parquet": _read_parquet}


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _image_files(folder: Path) -> list[tuple[str, Path]]:
    """(class, image) for every image in ``folder``'s class subfolders, in a fixed order."""
    classes = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    found = [
        (cls.name, image)
        for cls in classes
        for image in sorted(cls.iterdir())
        if image.suffix.lower() in _IMAGE_SUFFIXES
    ]
    if not found:
        raise ValueError(
            f"--data {folder}: no images in class subfolders; lay the folder out as "
            "FOLDER/<class name>/<image files> (png, jpg, …)"
        )
    return found


def _read_image_folder(folder: Path, label: str) -> FileData:
    """A folder of class subfolders of images (one size, one mode); the label is the subfolder."""
    from PIL import Image, UnidentifiedImageError

    pixels, labels = [], []
    shape: tuple[int, ...] | None = None
    mode = None
    for name, image in _image_files(folder):
        try:
            with Image.open(image) as opened:
                mode = mode or ("L" if opened.mode in ("1", "L", "P", "I", "I;16") else "RGB")
                array = np.asarray(opened.convert(mode), dtype=np.float64)
        except (OSError, UnidentifiedImageError) as err:
            raise ValueError(f"{image} is not a readable image ({err})") from None
        array = array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)  # (C, H, W)
        if shape is None:
            shape = array.shape
        elif array.shape != shape:
            raise ValueError(
                f"{image} is {array.shape[2]}×{array.shape[1]}, the first image "
                f"{shape[2]}×{shape[1]}; resize every image to one size before training"
            )
        pixels.append(array)
        labels.append(name)
    return FileData(np.stack(pixels), np.asarray(labels), (), "image folder")


def _read(path: Path, label: str) -> FileData:
    """The file's rows, read by the reader its suffix names (a folder: its images)."""
    if path.is_dir():
        return _read_image_folder(path, label)
    return _READERS[_suffix(path)](path, label)


def _input_shape(features: np.ndarray) -> tuple[int, ...]:
    """Rows of numbers are tabular (F,); (N, H, W) images get one channel; (N, C, H, W) stay."""
    shape = tuple(int(d) for d in features.shape[1:])
    return (1, *shape) if len(shape) == 2 else shape


def peek_input_shape(path: Path, label: str) -> tuple[int, ...]:
    """The input shape one example of ``path`` has (what the model is chosen from)."""
    if Path(path).is_dir():
        from PIL import Image

        with Image.open(_image_files(Path(path))[0][1]) as first:
            channels = 1 if first.mode in ("1", "L", "P", "I", "I;16") else 3
            return (channels, first.height, first.width)
    if _suffix(Path(path)) == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            others = [name for name in archive.files if name != label]
            key = next((k for k in _NPZ_FEATURE_KEYS if k in others), others[0] if others else "")
            return _input_shape(archive[key]) if key else ()
    return ()  # a table: rows of features, whatever their number


def model_for_shape(shape: tuple[int, ...]) -> str:
    """The model a shape calls for: images (C, H, W) a GroupNorm CNN, rows of numbers an MLP."""
    return "cnn" if len(shape) == 3 and min(shape[1:]) >= 8 else "mlp"


def _classes(labels: np.ndarray) -> tuple[str, ...]:
    """The distinct label values, in numeric order when all are integers, else text order."""
    distinct = sorted(set(labels.tolist()))
    try:
        return tuple(sorted(distinct, key=lambda v: float(v)))
    except ValueError:
        return tuple(distinct)


def _scale(
    train: np.ndarray, test: np.ndarray, declaration: ScaleDeclaration, columns: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the declared scale to both splits (fit: the training split's statistics)."""
    if declaration.kind == "as-is":
        return train, test
    if declaration.kind == "fit":
        flat = train.reshape(len(train), -1)
        scaler = fit_standardizer(flat)
        return (
            scaler(flat).reshape(train.shape),
            scaler(test.reshape(len(test), -1)).reshape(test.shape),
        )
    low, high = _bounds_arrays(declaration, columns, train[0].size)
    scaled = []
    for part in (train, test):
        flat = np.clip(part.reshape(len(part), -1), low, high)
        scaled.append((2.0 * (flat - low) / (high - low) - 1.0).reshape(part.shape))
    return scaled[0], scaled[1]


def _bounds_arrays(
    declaration: ScaleDeclaration, columns: tuple[str, ...], width: int
) -> tuple[np.ndarray, np.ndarray]:
    """One low and one high per feature, from one range for all or one per named column."""
    if "*" in declaration.ranges:
        low, high = declaration.ranges["*"]
        return np.full(width, low), np.full(width, high)
    missing = [name for name in columns if name not in declaration.ranges]
    if missing or len(columns) != width:
        raise ValueError(
            f"--feature-bounds {declaration.given} gives no range for "
            f"{', '.join(missing) or 'the array features'}; give every feature column a "
            "[low, high], or pass one LOW:HIGH for all"
        )
    extra = sorted(set(declaration.ranges) - set(columns))
    if extra:
        raise ValueError(
            f"--feature-bounds {declaration.given} names columns the file does not have: "
            f"{', '.join(extra)}"
        )
    pairs = np.asarray([declaration.ranges[name] for name in columns], dtype=np.float64)
    return pairs[:, 0], pairs[:, 1]


def _split(
    features: np.ndarray, labels: np.ndarray, path: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed stratified 80/20 split; a class too rare to stratify is named."""
    from sklearn.model_selection import train_test_split

    values, counts = np.unique(labels, return_counts=True)
    if values.size < 2:
        raise ValueError(f"{path}: the label column has one value ({values[0]}); need two classes")
    rare = values[counts < 2]
    if rare.size:
        raise ValueError(
            f"{path}: label {rare[0]!r} occurs once; each class needs at least two rows to be "
            "split 80/20 into train and test, or pass --test-data FILE"
        )
    return train_test_split(
        features, labels, test_size=_TEST_FRACTION, stratify=labels, random_state=_SPLIT_SEED
    )


def load_user_file(
    path: Path, label: str, feature_bounds: str | None, *, test_path: Path | None = None
) -> LoadedDataset:
    """The user's file as a :class:`LoadedDataset` whose record names the file and the scale.

    ``test_path`` (same columns) is the test split; without it the file is split 80/20,
    stratified, with seed 0 (the same split on every run).
    """
    declaration = parse_feature_bounds(feature_bounds)
    path = Path(path)
    data = _read(path, label)
    if test_path is None:
        x_train, x_test, y_train, y_test = _split(data.features, data.labels, path)
        split = f"stratified {1 - _TEST_FRACTION:.0%}/{_TEST_FRACTION:.0%} split of {path}, seed 0"
    else:
        test = _read(Path(test_path), label)
        if test.features.shape[1:] != data.features.shape[1:] or test.columns != data.columns:
            raise ValueError(
                f"--test-data {test_path} has other features than {path}; give both the same "
                "columns in the same order"
            )
        x_train, x_test, y_train, y_test = data.features, test.features, data.labels, test.labels
        split = f"training rows from {path}, test rows from {test_path}"
    classes = _classes(y_train)
    unknown = sorted(set(y_test.tolist()) - set(classes))
    if unknown:
        raise ValueError(
            f"the test rows hold label {unknown[0]!r}, which no training row has; every test "
            "class must occur in training"
        )
    index = {value: i for i, value in enumerate(classes)}
    named = "class subfolder names" if path.is_dir() else f"column {label!r}"
    x_train, x_test = _scale(x_train, x_test, declaration, data.columns)
    shape = _input_shape(data.features)
    steps = (
        declaration.describe(),
        f"label classes: the {len(classes)} distinct {named}, taken to be the task's public "
        "classes (their values are not printed: they were read from the private file, and a "
        "class only one person has would name them; the model's output size shows their count)",
    )
    return LoadedDataset(
        name=path.name,
        train=_tensors(x_train, np.array([index[v] for v in y_train]), shape),
        test=_tensors(x_test, np.array([index[v] for v in y_test]), shape),
        num_classes=len(classes),
        input_shape=shape,
        source=(
            f"{path.resolve()} ({data.kind}, labels from the {named}, "
            f"{len(data.columns) or int(np.prod(shape))} features)"
        ),
        preprocessing=Preprocessing(
            steps=steps, fitted_on_private_data=declaration.kind == "fit", declared_public=False
        ),
        split=split,
        class_names=classes,
    )
