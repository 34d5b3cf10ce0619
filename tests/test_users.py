"""The simulated user split partitions the data, is skewed as documented, and refuses bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from dpfy.data.users import UserSplit, split_users

LABELS = np.repeat(np.arange(10), 100)  # 1000 examples, 10 balanced classes


def _label_tv_distance(split: UserSplit, labels: np.ndarray) -> float:
    """Mean total-variation distance between each user's label histogram and the global one."""
    k = int(labels.max()) + 1
    overall = np.bincount(labels, minlength=k) / labels.size
    distances = []
    for user in range(split.num_users):
        mine = labels[split.indices(user).numpy()]
        distances.append(0.5 * np.abs(np.bincount(mine, minlength=k) / mine.size - overall).sum())
    return float(np.mean(distances))


def test_split_is_a_partition_with_every_user_at_least_min_examples():
    split = split_users(LABELS, 50, alpha=0.5, min_examples=4, seed=3)
    assert split.user_ids.shape == (LABELS.size,)
    assert split.sizes().sum() == LABELS.size
    assert split.sizes().min() >= 4
    seen = torch.cat([split.indices(u) for u in range(split.num_users)])
    assert torch.equal(seen.sort().values, torch.arange(LABELS.size))


def test_same_seed_same_split_other_seed_other_split():
    a = split_users(torch.as_tensor(LABELS), 30, seed=7)
    b = split_users(LABELS, 30, seed=7)
    c = split_users(LABELS, 30, seed=8)
    assert torch.equal(a.user_ids, b.user_ids)
    assert not torch.equal(a.user_ids, c.user_ids)


def test_small_alpha_skews_labels_and_large_alpha_approaches_iid():
    skewed = split_users(LABELS, 40, alpha=0.1, seed=0)
    iid = split_users(LABELS, 40, alpha=1000.0, seed=0)
    assert _label_tv_distance(skewed, LABELS) > 0.5
    assert _label_tv_distance(iid, LABELS) < 0.35
    assert _label_tv_distance(skewed, LABELS) > 2 * _label_tv_distance(iid, LABELS)


def test_user_sizes_are_skewed():
    sizes = split_users(LABELS, 100, alpha=1000.0, seed=0).sizes().float()
    assert sizes.max() > 4 * sizes.median()


def test_datasets_hold_each_users_examples():
    features = torch.arange(LABELS.size, dtype=torch.float32)[:, None]
    dataset = TensorDataset(features, torch.as_tensor(LABELS))
    split = split_users(LABELS, 12, seed=1)
    subsets = split.datasets(dataset)
    assert len(subsets) == 12
    for user, subset in enumerate(subsets):
        held = sorted(int(subset[i][0].item()) for i in range(len(subset)))
        assert held == split.indices(user).tolist()


def test_datasets_refuses_a_dataset_of_another_length():
    split = split_users(LABELS, 12, seed=1)
    other = TensorDataset(torch.zeros(LABELS.size - 1, 1))
    with pytest.raises(ValueError, match="pass the dataset whose labels were split"):
        split.datasets(other)


def test_describe_says_how_it_was_split():
    line = split_users(LABELS, 20, alpha=0.3, seed=5).describe()
    assert "20 simulated users" in line and "alpha=0.3" in line and "seed 5" in line
    assert "\n" not in line


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_users": 0}, "num_users"),
        ({"num_users": LABELS.size + 1}, "exceeds the 1000 examples"),
        ({"num_users": 10, "alpha": 0.0}, "alpha"),
        ({"num_users": 10, "alpha": -1.0}, "alpha"),
        ({"num_users": 10, "alpha": float("nan")}, "alpha"),
        ({"num_users": 10, "min_examples": 0}, "min_examples"),
        ({"num_users": 500, "min_examples": 3}, "lower num_users or min_examples"),
    ],
)
def test_bad_input_is_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        split_users(LABELS, **kwargs)


def test_two_dimensional_labels_refused():
    with pytest.raises(ValueError, match="1-D"):
        split_users(np.zeros((4, 2)), 2)


def test_indices_refuses_an_unknown_user():
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        split_users(LABELS, 5).indices(5)


@settings(max_examples=40, deadline=None)
@given(
    labels=st.lists(st.integers(0, 4), min_size=1, max_size=80),
    users=st.integers(1, 80),
    min_examples=st.integers(1, 5),
    alpha=st.floats(1e-3, 100.0),
    seed=st.integers(0, 2**16),
)
def test_any_feasible_request_gives_a_partition_meeting_the_minimum(
    labels, users, min_examples, alpha, seed
):
    if users * min_examples > len(labels):
        with pytest.raises(ValueError):
            split_users(np.array(labels), users, alpha=alpha, min_examples=min_examples)
        return
    split = split_users(np.array(labels), users, alpha=alpha, min_examples=min_examples, seed=seed)
    assert split.sizes().sum() == len(labels)
    assert split.sizes().min() >= min_examples
