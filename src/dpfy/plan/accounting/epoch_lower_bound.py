"""A proven lower bound on ε for batches that hold each example once per epoch (shuffled
batches, balls-in-bins): no accountant can certify less for them.

Shuffled batches are usually reported with the ε of Poisson sampling at q = B/N, an assumption
they do not meet; "To shuffle or not to shuffle" (Annamalai et al., NDSS 2026) and Chua et al.
("How private are DP-SGD implementations?", ICML 2024) show that this can overstate their privacy
several-fold. The lower bound here is theirs in kind: in the linear-query model in which the
Poisson ε is itself an upper bound, take the neighbouring pair in which every other example's
gradient is zero and the differing example's is a unit vector (zero-out adjacency). An epoch of
k batches then puts that example in one uniformly random batch (with probability kB/N for
shuffled batches, whose last N mod B examples sit out; with probability 1 for balls-in-bins,
where each example picks one of the k batches), and the adversary who keeps only the largest of
the epoch's k noisy sums along that direction sees, per epoch,

    P: max(Z₁ + μ·1[J = 1], …, Z_k + μ·1[J = k])  against  Q: max(Z₁, …, Z_k),  μ = 1/σ,

two one-dimensional laws with an increasing likelihood ratio. What that adversary distinguishes
lower-bounds what any can (post-processing), so the hockey-stick divergence of the epochs'
composition, computed with every privacy loss rounded *down* (which only lowers it), bounds the
mechanism's δ(ε) from below, and ε_lower(δ) = sup{ε : δ_lower(ε) > δ}. Numerically exact up to
floating point in the FFT (relative 1e-12 or so).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr

from dpfy._validate import check_count, check_delta, check_positive

__all__ = ["epoch_epsilon_lower_bound"]

_SPACING = 2e-3  # loss grid (rounded down to it)
_LOSS_FLOOR = -30.0  # losses below are raised to nothing: set to this floor (rounds down)
_POINTS = 40_000  # cells of the output's range
#: Epochs composed at most: leaving later epochs out only lowers the bound (post-processing) and
#: keeps its cost to a second or so however long the run.
MOST_EPOCHS = 256


def epoch_epsilon_lower_bound(
    noise_multiplier: float,
    batches_per_epoch: int,
    epochs: int,
    delta: float,
    *,
    in_epoch: float = 1.0,
    partial_batches: int = 0,
    partial_in_epoch: float = 0.0,
) -> float:
    """A lower bound on ε(δ) of ``epochs`` epochs of ``batches_per_epoch`` batches, σ each.

    ``in_epoch`` is the chance the example is in one of an epoch's batches (kB/N for shuffled
    batches, 1 for balls-in-bins); a last, unfinished epoch of ``partial_batches`` batches holds
    it with chance ``partial_in_epoch``. 0 when nothing was released. Beyond
    :data:`MOST_EPOCHS` epochs the later ones are left out (the bound stays a lower bound).
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    k = check_count("batches_per_epoch", batches_per_epoch, minimum=1)
    epochs = check_count("epochs", epochs)
    partial = check_count("partial_batches", partial_batches)
    delta = check_delta(delta)
    if epochs > MOST_EPOCHS:
        epochs, partial = MOST_EPOCHS, 0
    parts = []
    if epochs:
        parts.append((_epoch_losses(1 / sigma, k, in_epoch), epochs))
    if partial and partial_in_epoch > 0:
        parts.append((_epoch_losses(1 / sigma, partial, partial_in_epoch), 1))
    if not parts:
        return 0.0
    best = 0.0
    for direction in (0, 1):
        pmf, offset = _compose([(p[direction], n) for p, n in parts])
        best = max(best, _epsilon(pmf, offset, delta))
    return best


def _epoch_losses(
    mu: float, k: int, rate: float
) -> tuple[tuple[np.ndarray, int], tuple[np.ndarray, int]]:
    """Both directions' loss pmfs on the grid (P against Q, Q against P), losses rounded down."""
    t = np.linspace(-9.0, 9.0 + math.sqrt(2 * math.log(k + 1)) + mu, _POINTS + 1)
    log_q_cdf = k * log_ndtr(t)
    log_p1_cdf = (k - 1) * log_ndtr(t) + log_ndtr(t - mu)
    q_cdf = np.exp(log_q_cdf)
    p_cdf = rate * np.exp(log_p1_cdf) + (1 - rate) * q_cdf
    q_mass, p_mass = np.diff(q_cdf), np.diff(p_cdf)
    # ratio p/q at t: (1 − r) + r·[((k−1)/k)·Φ(t−μ)/Φ(t) + (1/k)·e^{μt − μ²/2}], increasing in t
    ratio = (1 - rate) + rate * (
        (k - 1) / k * np.exp(log_ndtr(t - mu) - log_ndtr(t)) + np.exp(mu * t - mu * mu / 2) / k
    )
    loss = np.log(ratio)
    # On a cell [t_i, t_{i+1}) the loss is at least loss[i] (P against Q), and minus it at least
    # −loss[i+1] (Q against P): the cell's lowest loss, so δ only shrinks.
    forward = _on_grid(np.maximum(loss[:-1], _LOSS_FLOOR), np.clip(p_mass, 0, None))
    backward = _on_grid(np.maximum(-loss[1:], _LOSS_FLOOR), np.clip(q_mass, 0, None))
    return forward, backward


def _on_grid(losses: np.ndarray, mass: np.ndarray) -> tuple[np.ndarray, int]:
    """Masses at losses rounded down to multiples of the spacing: (pmf, index of its first)."""
    index = np.floor(losses / _SPACING).astype(np.int64)
    low = int(index.min())
    pmf = np.bincount(index - low, weights=mass)
    return pmf, low


def _compose(parts: list[tuple[tuple[np.ndarray, int], int]]) -> tuple[np.ndarray, int]:
    """The pmf of the sum of independent losses (each part ``count`` times), by one FFT."""
    size, offset = 1, 0
    for (pmf, low), count in parts:
        size += count * (pmf.size - 1)
        offset += count * low
    length = 1 << (size - 1).bit_length()
    spectrum = np.ones(length // 2 + 1, dtype=complex)
    for (pmf, _), count in parts:
        spectrum *= np.fft.rfft(pmf, length) ** count
    total = np.fft.irfft(spectrum, length)[:size]
    return np.clip(total, 0.0, None), offset


def _epsilon(pmf: np.ndarray, offset: int, delta: float) -> float:
    """sup{ε ≥ 0 : Σ pmf·(1 − e^{ε − ℓ})₊ > δ} on the rounded-down losses ℓ."""
    losses = (offset + np.arange(pmf.size)) * _SPACING

    def excess(eps: float) -> float:
        above = losses > eps
        return float(np.sum(pmf[above] * -np.expm1(eps - losses[above]))) - delta

    if excess(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, float(losses.max())
    if excess(hi) > 0:
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return lo
