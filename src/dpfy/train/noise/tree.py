"""Online tree aggregation: the noise of DP-FTRL's private prefix sums (Kairouz et al. 2021).

DP-FTRL releases, at every step t, the prefix sum s_t = g_1 + … + g_t of clipped gradient sums.
It never noises s_t directly: a binary tree is laid over the stream, every node (the sum over a
dyadic block of steps) gets its own independent N(0, σ²C²) per coordinate, and s_t is read off
the O(log t) nodes of t's binary decomposition (Dwork, Naor, Pitassi & Rothblum 2010; Chan, Shi
& Song 2011; guide §4.3, tab. 3). One gradient sits in at most ⌈log₂(T+1)⌉ nodes, which is the
whole privacy cost (see :mod:`dpfy.plan.tree_events`).

Only the noise is tracked here: the noisy prefix sum is the exact clipped prefix sum plus
:meth:`TreeNoise.advance`'s cumulative noise. The stack holds one noise tensor per parameter and
per set bit of t — O(log T) tensors per parameter.

Two ways to turn nodes into prefix sums, chosen by name (:data:`TREE_VARIANTS`):

``"plain"``
    each node of the decomposition as drawn: Var(node) = σ²C², Var(prefix at t) = popcount(t)·σ²C².
``"efficient"``
    Honaker (2015, "Efficient use of differentially private binary trees"), in its online form:
    a completed node is re-estimated from its own noisy value and its two children's estimates,
    weighted by inverse variance. With v_0 = 1, the estimate at level ℓ has variance
    v_ℓ = 1 / (1 + 1/(2v_{ℓ−1})) = 2^ℓ / (2^{ℓ+1} − 1) (times σ²C²): below 1, tending to 1/2.
    The nodes released are the same, so the privacy is the same (post-processing).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dpfy._validate import check_count, check_positive
from dpfy.train.noise.source import NoiseSource


def node_variance(level: int, variant: str) -> float:
    """Variance of one node's noise estimate at ``level`` (leaves: 0), in units of σ²C²."""
    level = check_count("level", level)
    return _variant(variant).variance(level)


def prefix_variance(step: int, variant: str) -> float:
    """Variance of the noise on the prefix sum after ``step`` steps of one tree, in σ²C².

    The prefix [1, t] is the disjoint union of one node per set bit of t, with independent noise.
    """
    step = check_count("step", step, minimum=1)
    return sum(
        node_variance(level, variant) for level in range(step.bit_length()) if step >> level & 1
    )


@dataclass(frozen=True)
class _Variant:
    """How a completed parent's noise estimate is formed from its fresh draw and its children."""

    variance: Callable[[int], float]
    combine: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _plain_combine(level: int, fresh: torch.Tensor, children: torch.Tensor) -> torch.Tensor:
    """The node as drawn; the children's noise is forgotten."""
    return fresh


def _efficient_variance(level: int) -> float:
    """2^ℓ / (2^{ℓ+1} − 1): the fixed point of v_ℓ = 1/(1 + 1/(2 v_{ℓ−1})), v_0 = 1."""
    return 2.0**level / (2.0 ** (level + 1) - 1.0)


def _efficient_combine(level: int, fresh: torch.Tensor, children: torch.Tensor) -> torch.Tensor:
    """Inverse-variance weighting of the fresh node (variance 1) and the children (2 v_{ℓ−1})."""
    child_sum_variance = 2.0 * _efficient_variance(level - 1)
    weight = child_sum_variance / (1.0 + child_sum_variance)  # on the fresh draw
    return fresh.mul(weight).add_(children, alpha=1.0 - weight)


TREE_VARIANTS: dict[str, _Variant] = {
    "plain": _Variant(lambda level: 1.0, _plain_combine),
    "efficient": _Variant(_efficient_variance, _efficient_combine),
}


def _variant(name: str) -> _Variant:
    """Look a variant up by name, with an error listing the choices."""
    try:
        return TREE_VARIANTS[str(name)]
    except KeyError:
        raise ValueError(f"tree must be one of {', '.join(TREE_VARIANTS)}; got {name!r}") from None


class TreeNoise:
    """The noise of one tree's online prefix sums, per parameter; :meth:`reset` restarts it.

    ``like`` maps parameter names to tensors of the right shape (e.g. the clipped sums); ``std``
    is the per-node noise std σ·C (σ·2C for microbatch averages). Each :meth:`advance` adds one
    leaf, merges completed nodes, and returns the noise on the prefix sum up to that leaf.
    """

    def __init__(
        self,
        like: Mapping[str, torch.Tensor],
        std: float,
        noise: NoiseSource,
        variant: str = "efficient",
    ) -> None:
        self.std = check_positive("std", std)
        self.variant = str(variant)
        self._rule = _variant(variant)
        self._like = {name: torch.zeros_like(t) for name, t in like.items()}
        self.noise = noise
        self._stack: list[tuple[int, dict[str, torch.Tensor]]] = []  # (level, noise per param)
        self.steps = 0  # leaves added since the last reset

    def reset(self) -> None:
        """Start a fresh tree: the next :meth:`advance` is leaf 1 again (a restart)."""
        self._stack.clear()
        self.steps = 0

    def _draw(self) -> dict[str, torch.Tensor]:
        """Independent N(0, std²) for every coordinate of every parameter: one new node."""
        return {name: self.noise.normal(t, self.std) for name, t in self._like.items()}

    def advance(self) -> dict[str, torch.Tensor]:
        """Add leaf t+1 and return the noise on the prefix sum [1, t+1] (fresh tensors)."""
        level, node = 0, self._draw()
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            fresh = self._draw()  # the parent's own noisy value
            level += 1
            node = {
                name: self._rule.combine(level, fresh[name], left[name] + node[name])
                for name in node
            }
        self._stack.append((level, node))
        self.steps += 1
        return self.cumulative()

    def cumulative(self) -> dict[str, torch.Tensor]:
        """The noise on the current prefix sum: the sum over the decomposition's nodes."""
        total = {name: torch.zeros_like(t) for name, t in self._like.items()}
        for _, node in self._stack:
            for name, value in node.items():
                total[name].add_(value)
        return total

    @property
    def levels(self) -> list[int]:
        """Levels of the nodes held (the set bits of ``steps``, highest first): O(log T)."""
        return [level for level, _ in self._stack]

    def state_dict(self) -> dict[str, Any]:
        """The nodes held and the leaf count, for checkpoints."""
        return {
            "variant": self.variant,
            "steps": self.steps,
            "stack": [
                (level, {k: v.clone() for k, v in node.items()}) for level, node in self._stack
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a state of another variant or other parameters."""
        if state.get("variant") != self.variant:
            raise ValueError(
                f"tree state is for the {state.get('variant')!r} variant, this tree is "
                f"{self.variant!r}"
            )
        steps = check_count("steps", state["steps"])
        stack = [(check_count("level", level), dict(node)) for level, node in state["stack"]]
        if [lv for lv, _ in stack] != [lv for lv in range(steps.bit_length()) if steps >> lv & 1][
            ::-1
        ]:
            raise ValueError(f"tree state holds levels that do not match {steps} steps")
        for _, node in stack:
            if set(node) != set(self._like) or any(
                node[k].shape != self._like[k].shape for k in node
            ):
                raise ValueError("tree state is for other parameters than this model's")
        self._stack = [  # onto the parameters' devices (checkpoints load on the CPU)
            (lv, {k: v.to(self._like[k], copy=True) for k, v in node.items()}) for lv, node in stack
        ]
        self.steps = steps
