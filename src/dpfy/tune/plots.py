"""Tuning pictures as PNG files: the lr × C heatmap, the gradient-norm histogram, ClipSearch.

The heatmap is the guide's fig. 2 view (§5.4.1 step 3): validation accuracy over learning rate ×
clip norm at fixed σ, where near-equal accuracy runs along a diagonal of constant lr·C; the chosen
pair is marked. The histogram shows the unclipped per-example gradient norms the trials saw with
the chosen C (and the untuned default) marked, so one can see how much of the data C clips
(§5.4.1 step 2). Drawn on matplotlib's Agg canvas; no display or global backend needed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from dpfy.report.plots import save_png
from dpfy.tune.sweep import SweepGrid


def plot_lr_clip_heatmap(
    grid: SweepGrid, path: str | os.PathLike[str], *, noise_multiplier: float | None = None
) -> Path:
    """Write :func:`heatmap_figure` as a PNG."""
    return save_png(heatmap_figure(grid, noise_multiplier=noise_multiplier), path)


def heatmap_figure(grid: SweepGrid, *, noise_multiplier: float | None = None) -> Figure:
    """Validation accuracy (%) per (lr, C) cell, values written in, the chosen cell boxed."""
    figure = Figure(figsize=(1.3 * len(grid.clips) + 2.5, 0.8 * len(grid.lrs) + 2.0))
    axes = figure.add_subplot()
    values = np.ma.masked_invalid(grid.accuracy * 100.0)
    image = axes.imshow(values, origin="lower", cmap="viridis", aspect="auto")
    bar = figure.colorbar(image, ax=axes)
    bar.set_label("validation accuracy (%)")
    axes.set_xticks(range(len(grid.clips)), [f"{c:g}" for c in grid.clips])
    axes.set_yticks(range(len(grid.lrs)), [f"{lr:g}" for lr in grid.lrs])
    axes.set_xlabel("clip norm C (ℓ2 norm of a per-example gradient)")
    axes.set_ylabel("learning rate (per step)")
    finite = grid.accuracy[np.isfinite(grid.accuracy)]
    middle = float(np.mean(finite)) * 100 if finite.size else 0.0
    for i in range(len(grid.lrs)):
        for j in range(len(grid.clips)):
            value = grid.accuracy[i, j]
            text = "—" if math.isnan(value) else f"{100 * value:.1f}"
            colour = "black" if not math.isnan(value) and 100 * value > middle else "white"
            axes.text(j, i, text, ha="center", va="center", fontsize=8, color=colour)
    lr, clip = grid.chosen
    row, col = grid.lrs.index(lr), grid.clips.index(clip)
    axes.add_patch(_box(col, row))
    axes.plot([], [], "s", mfc="none", mec="red", mew=2, label=f"chosen: lr={lr:g}, C={clip:g}")
    axes.legend(loc="upper left", bbox_to_anchor=(0.0, -0.18), fontsize=8, frameon=False)
    sigma = "" if noise_multiplier is None else f" at σ = {noise_multiplier:.3g}"
    axes.set_title(f"lr × C sweep{sigma}: validation accuracy (%)", fontsize=10)
    figure.tight_layout()
    return figure


def _box(col: int, row: int) -> object:
    """A red square around one heatmap cell."""
    from matplotlib.patches import Rectangle

    return Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5)


def plot_grad_norms(
    norms: np.ndarray,
    clip: float,
    path: str | os.PathLike[str],
    *,
    default_clip: float | None = None,
) -> Path:
    """Write :func:`grad_norms_figure` as a PNG."""
    return save_png(grad_norms_figure(norms, clip, default_clip=default_clip), path)


def grad_norms_figure(
    norms: np.ndarray, clip: float, *, default_clip: float | None = None
) -> Figure:
    """Histogram of unclipped per-example gradient norms (log x), chosen C as a red line."""
    values = np.asarray(norms, dtype=float).ravel()
    values = values[np.isfinite(values) & (values > 0)]
    if values.size == 0:
        raise ValueError("no positive gradient norms to plot; run at least one non-empty step")
    figure = Figure(figsize=(7, 4))
    axes = figure.add_subplot()
    low = min(values.min(), clip, default_clip or clip) / 1.5
    high = max(values.max(), clip, default_clip or clip) * 1.5
    bins = np.geomspace(low, high, 50)
    axes.hist(values, bins=bins, color="tab:blue", alpha=0.8)
    axes.set_xscale("log")
    clipped = float(np.mean(values > clip))
    axes.axvline(
        clip, color="red", linewidth=2, label=f"chosen C = {clip:g} ({clipped:.0%} clipped)"
    )
    if default_clip is not None and default_clip != clip:
        share = float(np.mean(values > default_clip))
        axes.axvline(
            default_clip, color="grey", linestyle="--", linewidth=1.5,
            label=f"untuned default C = {default_clip:g} ({share:.0%} clipped)",
        )  # fmt: skip
    axes.axvline(float(np.median(values)), color="black", linestyle=":", linewidth=1.2,
                 label=f"median norm = {np.median(values):.3g}")  # fmt: skip
    axes.set_xlabel("per-example gradient ℓ2 norm before clipping (log scale)")
    axes.set_ylabel("number of per-example gradients")
    axes.set_title(
        f"Per-example gradient norms seen in the tuning trials (n = {values.size})\n"
        "NOT PRIVATE: raw statistics of the training data, for the curator only",
        fontsize=10,
    )
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def plot_clip_search(
    accuracy_by_clip: dict[float, float],
    chosen: float | None,
    tolerance: float,
    path: str | os.PathLike[str],
) -> Path:
    """Write :func:`clip_search_figure` as a PNG."""
    return save_png(clip_search_figure(accuracy_by_clip, chosen, tolerance), path)


def clip_search_figure(
    accuracy_by_clip: dict[float, float], chosen: float | None, tolerance: float
) -> Figure:
    """Validation accuracy (%) against C, the tolerance band below the best, chosen C marked."""
    clips = sorted(accuracy_by_clip)
    accs = [100 * accuracy_by_clip[c] for c in clips]
    figure = Figure(figsize=(7, 4))
    axes = figure.add_subplot()
    axes.plot(clips, accs, "o-", color="tab:blue", label="validation accuracy")
    best = max(accs)
    axes.axhline((1 - tolerance) * best, color="grey", linestyle="--",
                 label=f"within {tolerance:.0%} of the best ({best:.1f}%)")  # fmt: skip
    if chosen is not None and chosen in accuracy_by_clip:
        axes.plot([chosen], [100 * accuracy_by_clip[chosen]], "*", color="red", markersize=16,
                  label=f"chosen C = {chosen:g}")  # fmt: skip
    axes.set_xscale("log")
    axes.set_xlabel("clip norm C (ℓ2 norm of a per-example gradient, log scale)")
    axes.set_ylabel("validation accuracy (%)")
    axes.set_title("ClipSearch: the smallest C within the tolerance of the best accuracy")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


__all__ = [
    "clip_search_figure",
    "grad_norms_figure",
    "heatmap_figure",
    "plot_clip_search",
    "plot_grad_norms",
    "plot_lr_clip_heatmap",
]
