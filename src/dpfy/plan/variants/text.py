"""How the report names a training algorithm: plain sentences each variant brings with it.

Torch-free text, kept with the variant's registration so that a new variant brings its own
words and the report never branches on a name (:mod:`dpfy.report.wording` fills the templates).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CENTRAL",
    "AlgorithmText",
    "UserLevelText",
    "central_gradients",
    "gaussian_accounting",
]


@dataclass(frozen=True)
class AlgorithmText:
    """How the report names one training algorithm and what it noises (guide §3, §4.2, §4.4)."""

    name: str  # as in "full-training DP via {name}"
    curator: str  # who sees the raw data, and what the guarantee protects
    guide: str  # where the guide describes the setting
    released_from: str  # what the released models are computed from
    steps: str  # what the ε counts, in the plural
    accounting: str  # how it is accounted; fields {accountant}, {sigma}, {q}
    clipped: str  # the vector clipped once per unit, as in "per-example {clipped} norms"


@dataclass(frozen=True)
class UserLevelText:
    """What a user-level variant clips per user and how a step draws users (guide §2.1, §4.4)."""

    clipped: str  # what one user contributes, clipped as one unit
    detail: str  # how a step draws users; fields {q}, {used}


CENTRAL = (
    "a trusted curator: the training process sees the raw private data, and only its outputs "
    "are protected"
)


def gaussian_accounting(clipped_sum: str) -> str:
    """A Gaussian accounting statement, noise on the sum of clipped ``clipped_sum``.

    How the batches were drawn (Poisson, truncated, balls-in-bins, …) and what that lets the
    accountant charge is the sampling statement's, not this one's.
    """
    return (
        "Accounted with the {accountant} accountant over every recorded step: each step adds "
        "Gaussian noise with noise multiplier σ = {sigma:.6g} (noise std "
        f"σ·sensitivity on the sum of clipped {clipped_sum}, decoupled from C, guide §4.2) to a "
        "batch drawn at rate q = {q:.6g}, charged as the sampling below states."
    )


def central_gradients(name: str, accounting: str) -> AlgorithmText:
    """Central DP over noised gradient steps (DP-SGD, DP-FTRL, BandMF, BLT): only ``name`` and
    how it is accounted differ."""
    return AlgorithmText(
        name=name,
        curator=CENTRAL,
        guide="guide §3.1–§3.2",
        released_from="the noised gradients",
        steps="noised gradient steps",
        accounting=accounting,
        clipped="gradient",
    )
