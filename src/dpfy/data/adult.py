"""Parse the UCI Adult (census income) data and encode it with a *public* vocabulary.

The one-hot categories come from the attribute values listed in the UCI ``adult.names`` file
(below), not from the rows being read, so the feature layout reveals nothing about the private
data (guide §5.5.1: a vocabulary learned from data is a release). A value outside the list, or a
missing value (``?``), encodes as all zeros in that attribute's block — documented, not an error,
because real extracts contain both. Labels: ``>50K`` is class 1, ``<=50K`` class 0 (a trailing
``.``, as in ``adult.test``, is ignored).

Accepted files: the standard headerless ``adult.data`` / ``adult.test`` (15 comma-separated
columns; ``adult.test`` starts with a ``|1x3 Cross validator`` line), or a CSV with a header row
naming the columns, incl. ``income`` (``educational-num`` and ``gender`` accepted as aliases).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "CATEGORIES",
    "CLASS_NAMES",
    "COLUMNS",
    "NUMERIC",
    "AdultFormatError",
    "AdultTable",
    "encode",
    "feature_names",
    "read_adult",
]

NUMERIC: tuple[str, ...] = (
    "age",
    "fnlwgt",
    "education-num",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
)

# Attribute values exactly as listed in the UCI adult.names file (public, data-independent).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "workclass": (
        "Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov", "State-gov",
        "Without-pay", "Never-worked",
    ),
    "education": (
        "Bachelors", "Some-college", "11th", "HS-grad", "Prof-school", "Assoc-acdm", "Assoc-voc",
        "9th", "7th-8th", "12th", "Masters", "1st-4th", "10th", "Doctorate", "5th-6th",
        "Preschool",
    ),
    "marital-status": (
        "Married-civ-spouse", "Divorced", "Never-married", "Separated", "Widowed",
        "Married-spouse-absent", "Married-AF-spouse",
    ),
    "occupation": (
        "Tech-support", "Craft-repair", "Other-service", "Sales", "Exec-managerial",
        "Prof-specialty", "Handlers-cleaners", "Machine-op-inspct", "Adm-clerical",
        "Farming-fishing", "Transport-moving", "Priv-house-serv", "Protective-serv",
        "Armed-Forces",
    ),
    "relationship": (
        "Wife", "Own-child", "Husband", "Not-in-family", "Other-relative", "Unmarried",
    ),
    "race": ("White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"),
    "sex": ("Female", "Male"),
    "native-country": (
        "United-States", "Cambodia", "England", "Puerto-Rico", "Canada", "Germany",
        "Outlying-US(Guam-USVI-etc)", "India", "Japan", "Greece", "South", "China", "Cuba",
        "Iran", "Honduras", "Philippines", "Italy", "Poland", "Jamaica", "Vietnam", "Mexico",
        "Portugal", "Ireland", "France", "Dominican-Republic", "Laos", "Ecuador", "Taiwan",
        "Haiti", "Columbia", "Hungary", "Guatemala", "Nicaragua", "Scotland", "Thailand",
        "Yugoslavia", "El-Salvador", "Trinadad&Tobago", "Peru", "Hong", "Holand-Netherlands",
    ),
}  # fmt: skip

COLUMNS: tuple[str, ...] = (
    "age", "workclass", "fnlwgt", "education", "education-num", "marital-status", "occupation",
    "relationship", "race", "sex", "capital-gain", "capital-loss", "hours-per-week",
    "native-country", "income",
)  # fmt: skip

CLASS_NAMES: tuple[str, ...] = ("<=50K", ">50K")
_ALIASES = {"educational-num": "education-num", "gender": "sex", "class": "income"}
_LABELS = {"<=50k": 0, ">50k": 1}


class AdultFormatError(ValueError):
    """The file does not look like UCI Adult data (wrong columns, bad number or label)."""


@dataclass(frozen=True)
class AdultTable:
    """Raw rows: numeric columns as float64, categorical columns as stripped strings, labels."""

    numeric: np.ndarray
    categorical: dict[str, list[str]]
    labels: np.ndarray


def feature_names() -> list[str]:
    """Names of the encoded columns: the numeric ones, then ``attribute=value`` per category."""
    names = list(NUMERIC)
    for attribute, values in CATEGORIES.items():
        names.extend(f"{attribute}={value}" for value in values)
    return names


def _canonical(column: str) -> str:
    """Normalise a header name: lower case, ``_``/``.``/space to ``-``, known aliases mapped."""
    name = column.strip().lower().replace("_", "-").replace(".", "-").replace(" ", "-")
    return _ALIASES.get(name, name)


def _rows(path: Path) -> tuple[tuple[str, ...], list[list[str]]]:
    """The column names and the data rows of ``path`` (header row detected by ``income``)."""
    with path.open(newline="", encoding="utf-8") as handle:
        rows = [
            [cell.strip() for cell in row]
            for row in csv.reader(handle)
            if row and not row[0].startswith("|") and any(cell.strip() for cell in row)
        ]
    if rows and "income" in {_canonical(cell) for cell in rows[0]}:
        return tuple(_canonical(cell) for cell in rows[0]), rows[1:]
    return COLUMNS, rows


def _label(value: str, where: str) -> int:
    """Map an income string (``>50K``, ``<=50K.``, any case) to its class."""
    label = _LABELS.get(value.rstrip(".").strip().lower())
    if label is None:
        raise AdultFormatError(f"{where}: income must be '<=50K' or '>50K', got {value!r}")
    return label


def read_adult(path: str | Path) -> AdultTable:
    """Read one Adult file (headerless UCI format, or a CSV with a header) into a table."""
    path = Path(path)
    header, rows = _rows(path)
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise AdultFormatError(f"{path}: missing column(s) {missing}; found {list(header)}")
    index = {name: header.index(name) for name in COLUMNS}
    numeric = np.empty((len(rows), len(NUMERIC)), dtype=np.float64)
    labels = np.empty(len(rows), dtype=np.int64)
    for r, row in enumerate(rows):
        where = f"{path}, data row {r + 1}"
        if len(row) != len(header):
            raise AdultFormatError(f"{where}: {len(row)} fields, expected {len(header)}")
        try:
            numeric[r] = [float(row[index[c]]) for c in NUMERIC]
        except ValueError as err:
            raise AdultFormatError(f"{where}: a numeric column is not a number ({err})") from None
        for column, value in zip(NUMERIC, numeric[r], strict=True):
            if not math.isfinite(value):
                raise AdultFormatError(
                    f"{where}, column {column}: {row[index[column]]!r} is not a finite number; "
                    "remove or impute that value (dpfy refuses NaN and infinite features: they "
                    "make NaN predictions and gradients)"
                )
        labels[r] = _label(row[index["income"]], where)
    categorical = {a: [row[index[a]] for row in rows] for a in CATEGORIES}
    return AdultTable(numeric=numeric, categorical=categorical, labels=labels)


def encode(table: AdultTable) -> np.ndarray:
    """Numeric columns followed by one-hot blocks over the public UCI values (unknown -> zeros)."""
    blocks = [table.numeric]
    for attribute, values in CATEGORIES.items():
        position = {value.lower(): i for i, value in enumerate(values)}
        block = np.zeros((len(table.labels), len(values)), dtype=np.float64)
        for r, value in enumerate(table.categorical[attribute]):
            column = position.get(value.lower())
            if column is not None:
                block[r, column] = 1.0
        blocks.append(block)
    return np.concatenate(blocks, axis=1)
