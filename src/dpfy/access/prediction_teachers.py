"""Train the ensemble's teachers: plain torch, each on its own partition only.

The teachers are not private models — they fit their partitions without clipping or noise — so
they must never leave the server; only the noisy aggregate of their votes is released. What the
DP argument needs from training is that teacher ``t`` sees partition ``t`` alone and that its
randomness (initialisation, shuffling) comes from its own seed, never from the other partitions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from dpfy._validate import check_count, check_learning_rate


def teacher_seed(seed: int, teacher: int) -> int:
    """Teacher ``teacher``'s own seed: fixed by the run's seed and its index, not by any data."""
    return int(np.random.SeedSequence([seed, teacher]).generate_state(1, np.uint64)[0] >> 1)


def train_teacher(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> nn.Module:
    """Fit ``model`` to one partition with Adam and cross-entropy (non-private, on purpose)."""
    epochs = check_count("epochs", epochs, minimum=1)
    batch_size = check_count("batch_size", batch_size, minimum=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=check_learning_rate("lr", lr))
    generator = torch.Generator().manual_seed(seed)
    criterion = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs if len(labels) else 0):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad()
            criterion(model(features[batch]), labels[batch]).backward()
            optimizer.step()
    return model.eval()


def train_teachers(
    make_model: Callable[[], nn.Module],
    features: torch.Tensor,
    labels: torch.Tensor,
    partitions: Sequence[np.ndarray],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[nn.Module]:
    """One fresh model per partition, initialised from the teacher's seed and fitted to it."""
    teachers = []
    for t, rows in enumerate(partitions):
        own = teacher_seed(seed, t)
        torch.manual_seed(own)
        index = torch.as_tensor(rows, dtype=torch.long)
        model = make_model()
        teachers.append(
            train_teacher(
                model,
                features[index],
                labels[index],
                epochs=epochs,
                batch_size=batch_size,
                lr=lr,
                seed=own,
            )
        )
    return teachers


@torch.no_grad()
def teacher_votes(teachers: Sequence[nn.Module], queries: torch.Tensor) -> torch.Tensor:
    """Each teacher's predicted class for each query: a (teachers × queries) tensor."""
    return torch.stack([teacher(queries).argmax(dim=1) for teacher in teachers])
