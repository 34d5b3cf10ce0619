"""Many distinct sampled Gaussians, composed as fewer dominating ones: a pessimistic coarsening.

A run whose σ or q changes every step has as many distinct leaves as steps, and each distinct
leaf costs one FFT over the whole composed window. Beyond ``MANY_LEAVES`` of them, each leaf is
replaced by one that dominates it, on a fixed geometric grid:

* the sampling rate is rounded *up* (q' ≥ q): the pair at rate q is the pair at rate q'
  post-processed by keeping each sampled record with probability q/q' (Balle, Barthe & Gaboardi
  2018, "Privacy amplification by subsampling"), in both directions of add-or-remove;
* the Gaussian's μ = sensitivity/σ is rounded *up* (σ' ≤ σ): N(μ, 1) vs N(0, 1) is the pair at
  μ' post-processed by scaling and adding independent noise.

Each rounded leaf dominates its original, and composition preserves domination (Zhu, Dong &
Wang 2022, Thm. 10), so ε stays an upper bound; it grows by about half a grid step times the
elasticity of ε in that parameter. A coordinate that is the same for every sampled Gaussian (a
fixed q with a σ schedule, say) is left exact. Unsampled Gaussians compose exactly into one
Gaussian with μ² summed (their PLDs are Gaussian), so they are merged rather than rounded.

The grid is fixed (powers of 1 + resolution, the same for every composition), so a leaf's
rounding depends on nothing else composed except whether its coordinate varies at all;
``always`` rounds whatever varies even below ``MANY_LEAVES`` leaves, which dominates both
choices and is what the ledger's budget guard plans with (keeping fixed what has been fixed).
"""

from __future__ import annotations

import math

#: Up to this many distinct leaves are composed exactly: that many FFTs stay cheap, and so few
#: steps would each sit alone in a grid cell, where rounding up costs the most.
MANY_LEAVES = 256
#: Values within this relative distance of a grid point round to it (floating-point slack).
_ON_GRID = 1e-9


def round_up(value: float, resolution: float) -> float:
    """The smallest grid point (1 + resolution)^k that is ≥ value."""
    step = math.log1p(resolution)
    k = math.ceil(math.log(value) / step - _ON_GRID)
    return math.exp(k * step)


def dominating_gaussians(
    leaves: dict[tuple[float, float], int], resolution: float
) -> dict[tuple[float, float], int]:
    """Gaussian leaves (μ, q) → count, each rounded up on the grid (see module).

    A coordinate is rounded only where it varies; unsampled leaves (q = 1) are merged into one
    leaf of μ = √(Σ count·μ²) and count 1.
    """
    sampled = {key: n for key, n in leaves.items() if key[1] < 1.0}
    plain = sum(n * key[0] ** 2 for key, n in leaves.items() if key[1] >= 1.0)
    round_mu = len({mu for mu, _ in sampled}) > 1
    round_q = len({q for _, q in sampled}) > 1
    out: dict[tuple[float, float], int] = {}
    for (mu, q), n in sampled.items():
        key = (
            round_up(mu, resolution) if round_mu else mu,
            min(1.0, round_up(q, resolution)) if round_q else q,
        )
        out[key] = out.get(key, 0) + n
    if plain:
        key = (math.sqrt(plain), 1.0)
        out[key] = out.get(key, 0) + 1
    return out
