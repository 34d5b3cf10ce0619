"""Disjoint teacher partitions by a fixed per-record rule (prediction-level DP's sensitivity).

GNMax's sensitivity argument (Papernot et al. 2018, §4.1) needs one record to reach one teacher
only, *whatever the other records are*. Dealing records out by position (the first N/T to teacher
0, …) breaks that: removing one record shifts every later record into another partition, and the
one record then changes many teachers. Here a record's teacher is a keyed hash of the record's own
bytes (features and label), so adding or removing a record leaves every other record where it was.
Identical records land with the same teacher, as one record's copies should.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from dpfy._validate import check_count


def partition_key(seed: int) -> bytes:
    """The hash key for ``seed``: public, fixed before any data is seen."""
    return hashlib.sha256(f"dpfy.prediction.partition:{int(seed)}".encode()).digest()[:16]


def record_partition(features: torch.Tensor, label: int, teachers: int, key: bytes) -> int:
    """The teacher one record belongs to: a keyed BLAKE2b of its float32 bytes and its label."""
    digest = hashlib.blake2b(key=key, digest_size=8)
    digest.update(features.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    digest.update(int(label).to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest(), "little") % teachers


def assign_partitions(
    features: torch.Tensor, labels: torch.Tensor, teachers: int, seed: int
) -> np.ndarray:
    """Each record's teacher (an int array of length N); depends on each record alone."""
    teachers = check_count("teachers", teachers, minimum=1)
    if len(features) != len(labels):
        raise ValueError(
            f"features and labels must have one row per record; got {len(features)} and "
            f"{len(labels)}"
        )
    key = partition_key(seed)
    return np.fromiter(
        (record_partition(x, int(y), teachers, key) for x, y in zip(features, labels, strict=True)),
        dtype=np.int64,
        count=len(labels),
    )


def partition_indices(assignment: np.ndarray, teachers: int) -> list[np.ndarray]:
    """The record indices of each teacher's partition, in dataset order."""
    return [np.flatnonzero(assignment == t) for t in range(teachers)]
