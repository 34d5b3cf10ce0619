"""Public per-feature bounds of the bundled datasets, for input-level DP's local randomiser.

A local randomiser's noise is calibrated to the largest distance between two records, so every
feature needs a bound known before the data is seen. These come from what each dataset
publishes — pixel ranges, and the ranges :mod:`dpfy.data.public_ranges` scales tabular features
with — never from the rows themselves; the randomiser clips each record into them first.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfy.access.input_dp import FeatureBounds

__all__ = ["PUBLIC_BOUNDS", "PublicBox", "bounds_for"]


@dataclass(frozen=True)
class PublicBox:
    """One range for every feature as the dataset is loaded, and how it must be loaded."""

    low: float
    high: float
    standardize: bool
    source: str


_PIXELS = PublicBox(
    0.0,
    1.0,
    False,
    "pixel values 0..255 scaled by 1/255 (not standardised): every feature in [0, 1]",
)

#: The bundled datasets whose features have public bounds (the others are refused).
PUBLIC_BOUNDS: dict[str, PublicBox] = {
    "digits": PublicBox(
        0.0, 1.0, True, "pixel values 0..16 scaled by 1/16: every feature in [0, 1]"
    ),
    "mnist": _PIXELS,
    "fashion-mnist": _PIXELS,
    "breast-cancer": PublicBox(
        -1.0,
        1.0,
        True,
        "the published per-feature ranges, scaled and clipped into [-1, 1]",
    ),
    "adult": PublicBox(
        -1.0,
        1.0,
        True,
        "numeric features scaled and clipped into [-1, 1] between the census coding's bounds; "
        "one-hot categories in {0, 1}",
    ),
}


def bounds_for(dataset: str, features: int) -> tuple[FeatureBounds, bool]:
    """The dataset's public bounds for ``features`` features, and whether to standardise it."""
    box = PUBLIC_BOUNDS.get(dataset)
    if box is None:
        raise ValueError(
            f"{dataset!r} has no public feature bounds: input-level DP needs a finite bound on "
            "every feature, published before the data is seen; use one of "
            f"{', '.join(sorted(PUBLIC_BOUNDS))}, or pass FeatureBounds to InputRandomiser"
        )
    return FeatureBounds.uniform(box.low, box.high, features, box.source), box.standardize
