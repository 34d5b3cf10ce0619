"""Randomised response with a prior (RRWithPrior, Ghazi et al. 2021, "Deep learning with label
differential privacy", NeurIPS, Alg. 2): ε-label-DP that spends the randomisation on likely labels.

Given a prior p over the k classes for one example (computed from its public features and from
earlier, already-released noisy labels — never from its own label), RRWithPrior keeps only the
top-k' classes of p, with k' chosen to maximise the chance of reporting the true label,

    k* = argmax_{k'} (e^ε / (e^ε + k' − 1)) · Σ_{y ∈ top-k'(p)} p_y,

and runs k*-ary randomised response restricted to those classes: a label inside the set is kept
with probability e^ε/(e^ε + k* − 1) and otherwise replaced uniformly by another member; a label
outside it is replaced by a uniform member. Every output has probability between
1/(e^ε + k* − 1) and e^ε/(e^ε + k* − 1) whatever the true label, so it is ε-DP for the label
(paper, Thm 3). With a uniform prior k* = k and this is plain k-ary randomised response.
"""

from __future__ import annotations

import math

import numpy as np

from dpfy._validate import check_count, check_positive
from dpfy.plan.mechanisms import (
    _as_labels,
    _generator,
    randomized_response,
    randomized_response_keep_probability,
)

__all__ = [
    "randomized_response_with_prior",
    "rr_channel",
    "rr_prior_channels",
    "rr_prior_output_distribution",
    "top_k_choice",
]


def _keep_probabilities(num_classes: int, epsilon: float) -> np.ndarray:
    """e^ε/(e^ε + k' − 1) for k' = 1 … k: RR's keep chance on a k'-label set (1 when k' = 1)."""
    sizes = np.arange(1, num_classes + 1, dtype=float)
    return 1.0 / (1.0 + (sizes - 1.0) * math.exp(-epsilon))


def _checked_priors(priors: np.ndarray) -> np.ndarray:
    """Priors as an (n, k) array of finite, non-negative rows; a bad prior is a clear error."""
    array = np.asarray(priors, dtype=float)
    if array.ndim != 2 or array.shape[1] < 2:
        raise ValueError(f"priors must have shape (n, num_classes ≥ 2), got {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError("priors must be finite and non-negative (class probabilities)")
    return array


def top_k_choice(priors: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row's classes by decreasing prior, and the k* that maximises the keep probability.

    Ties in the prior are broken by class index (a stable sort), so the set depends only on the
    prior. Returns ``(order, k_star)``: ``order[i, :k_star[i]]`` is example i's label set.
    """
    array = _checked_priors(priors)
    epsilon = check_positive("epsilon", epsilon)
    order = np.argsort(-array, axis=1, kind="stable")
    mass = np.cumsum(np.take_along_axis(array, order, axis=1), axis=1)
    objective = mass * _keep_probabilities(array.shape[1], epsilon)
    return order, np.argmax(objective, axis=1) + 1


def randomized_response_with_prior(
    labels: np.ndarray,
    priors: np.ndarray,
    epsilon: float,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """RRWithPrior on each label (one release per label, each ε-label-DP); returns the outputs.

    Inside the chosen top-k* set the randomisation is :func:`dpfy.plan.mechanisms.
    randomized_response` on the label's rank in the set; a label outside the set is replaced by
    a uniform member of it.
    """
    order, k_star = top_k_choice(priors, epsilon)
    true = _as_labels(np.asarray(labels).reshape(-1), order.shape[1])
    if true.shape[0] != order.shape[0]:
        raise ValueError(
            f"one prior per label needed: {true.shape[0]} labels, {order.shape[0]} priors"
        )
    generator = _generator(rng)
    rank = np.argmax(order == true[:, None], axis=1)  # position of the true label in the order
    inside = rank < k_star
    reported_rank = np.zeros_like(true)
    outside = ~inside
    reported_rank[outside] = np.floor(generator.random(int(outside.sum())) * k_star[outside])
    for size in np.unique(k_star[inside]):
        if size < 2:
            continue  # a one-label set always reports that label (rank 0)
        members = inside & (k_star == size)
        noisy = randomized_response(rank[members], int(size), epsilon, rng=generator).output
        reported_rank[members] = noisy
    return np.take_along_axis(order, reported_rank[:, None], axis=1)[:, 0]


def rr_prior_output_distribution(prior: np.ndarray, label: int, epsilon: float) -> np.ndarray:
    """The exact output distribution of RRWithPrior for one prior and true label (for checks)."""
    order, k_star = top_k_choice(np.asarray(prior, dtype=float)[None, :], epsilon)
    num_classes = check_count("num_classes", order.shape[1], minimum=2)
    size = int(k_star[0])
    members = order[0, :size]
    distribution = np.zeros(num_classes)
    if label in members:
        keep = randomized_response_keep_probability(size, epsilon) if size > 1 else 1.0
        distribution[members] = (1.0 - keep) / max(size - 1, 1)
        distribution[label] = keep
    else:
        distribution[members] = 1.0 / size
    return distribution


def rr_channel(num_classes: int, epsilon: float) -> np.ndarray:
    """k-ary RR's channel M[y, ŷ] = P[report ŷ | label y]: keep on the diagonal, rest uniform."""
    keep = randomized_response_keep_probability(num_classes, epsilon)
    channel = np.full((num_classes, num_classes), (1.0 - keep) / (num_classes - 1))
    np.fill_diagonal(channel, keep)
    return channel


def rr_prior_channels(priors: np.ndarray, epsilon: float) -> np.ndarray:
    """Each example's RRWithPrior channel M_i[y, ŷ], from its public prior alone: (n, k, k).

    A label inside the top-k* set is kept w.p. e^ε/(e^ε + k* − 1), else moved uniformly within
    the set; a label outside it goes to a uniform member. Outputs outside the set never occur.
    """
    order, k_star = top_k_choice(priors, epsilon)
    n, num_classes = order.shape
    inside = np.zeros((n, num_classes), dtype=bool)
    np.put_along_axis(inside, order, np.arange(num_classes)[None, :] < k_star[:, None], axis=1)
    size = k_star.astype(float)[:, None, None]
    keep = np.where(size > 1, 1.0 / (1.0 + (size - 1.0) * math.exp(-epsilon)), 1.0)
    move = np.where(size > 1, (1.0 - keep) / np.maximum(size - 1.0, 1.0), 0.0)
    targets = inside[:, None, :].astype(float)  # ŷ must lie in the set
    channel = np.where(inside[:, :, None], move * targets, targets / size)
    eye = np.eye(num_classes, dtype=bool)[None, :, :] & inside[:, :, None]
    return np.where(eye, np.broadcast_to(keep, channel.shape), channel)
