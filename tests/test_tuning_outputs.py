"""`dpfy tune` bad input (refused before anything is written) and the tuning plots."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from matplotlib.patches import Rectangle
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.tune.plots import (
    clip_search_figure,
    grad_norms_figure,
    heatmap_figure,
    plot_grad_norms,
    plot_lr_clip_heatmap,
)
from dpfy.tune.sweep import SweepGrid


def _tune(tmp_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["tune", "--out", str(tmp_path / "out"), *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "needs an accounting method"),
        (("--tuning-accounting", "compose", "--clip-grid", ""), "grid is empty"),
        (
            ("--tuning-accounting", "compose", "--tolerance", "1.5"),
            r"tolerance must lie in \(0, 1\)",
        ),
        (("--tuning-accounting", "compose", "--tolerance", "0"), r"tolerance must lie in \(0, 1\)"),
        (("--tuning-accounting", "public"), "needs --public-data"),
        (("--tuning-accounting", "guess"), "'guess' is not one of 'compose'"),
        (("--tuning-accounting", "compose", "--search", "grid"), "'grid' is not one of 'clip'"),
        (
            ("--tuning-accounting", "random-trials", "--distribution=geometric", "--trials=1"),
            "random-trials: mean must lie in.*raise --trials",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    code, output = _tune(tmp_path, *args)
    assert code == 2
    assert "error:" in output and re.search(message, output)
    assert "Traceback" not in output
    assert not (tmp_path / "out").exists()


def test_missing_method_lists_every_choice(tmp_path: Path) -> None:
    code, output = _tune(tmp_path, "--search", "clip")
    assert code == 2
    for name in ("compose", "exponential", "random-trials", "public"):
        assert name in output


GRID = SweepGrid(
    lrs=(0.01, 0.1, 1.0),
    clips=(0.1, 1.0, 10.0),
    accuracy=np.array([[0.2, 0.5, 0.9], [0.5, 0.9, 0.6], [0.9, 0.6, np.nan]]),
    chosen=(0.1, 1.0),
)


def _has_red(path: Path) -> bool:
    pixels = matplotlib.image.imread(path)
    red = (pixels[..., 0] > 0.8) & (pixels[..., 1] < 0.25) & (pixels[..., 2] < 0.25)
    return int(red.sum()) > 20


def test_heatmap_labels_axes_with_units_and_marks_the_chosen_cell(tmp_path: Path) -> None:
    figure = heatmap_figure(GRID, noise_multiplier=1.1)
    axes = figure.axes[0]
    assert "learning rate" in axes.get_ylabel()
    assert "clip norm C" in axes.get_xlabel() and "norm" in axes.get_xlabel()
    assert "σ = 1.1" in axes.get_title()
    assert "validation accuracy (%)" in figure.axes[1].get_ylabel()  # the colour bar
    assert [t.get_text() for t in axes.get_xticklabels()] == ["0.1", "1", "10"]
    boxes = [p for p in axes.patches if isinstance(p, Rectangle)]
    assert len(boxes) == 1 and boxes[0].get_xy() == (0.5, 0.5)  # column C=1, row lr=0.1
    cells = {t.get_text() for t in axes.texts}
    assert {"90.0", "50.0", "—"} <= cells
    path = plot_lr_clip_heatmap(GRID, tmp_path / "heat.png")
    assert path.stat().st_size > 0 and _has_red(path)


def test_histogram_marks_c_and_says_how_much_it_clips(tmp_path: Path) -> None:
    norms = np.r_[np.full(75, 0.5), np.full(25, 5.0)]
    figure = grad_norms_figure(norms, 1.0, default_clip=10.0)
    axes = figure.axes[0]
    assert "norm" in axes.get_xlabel() and "log" in axes.get_xlabel()
    assert "number" in axes.get_ylabel()
    assert "NOT PRIVATE" in axes.get_title()  # raw statistics of private data
    labels = [line.get_label() for line in axes.get_lines()]
    assert any("chosen C = 1" in s and "25% clipped" in s for s in labels)
    assert any("default C = 10" in s and "0% clipped" in s for s in labels)
    red = [line for line in axes.get_lines() if line.get_color() == "red"]
    assert red and red[0].get_xdata()[0] == 1.0
    path = plot_grad_norms(norms, 1.0, tmp_path / "norms.png")
    assert _has_red(path)
    with pytest.raises(ValueError, match="no positive gradient norms"):
        grad_norms_figure(np.zeros(0), 1.0)


def test_clip_search_plot_marks_the_chosen_c() -> None:
    figure = clip_search_figure({0.1: 0.8, 1.0: 0.9, 10.0: 0.91}, 1.0, 0.02)
    axes = figure.axes[0]
    star = [line for line in axes.get_lines() if line.get_label() == "chosen C = 1"]
    assert star and star[0].get_ydata()[0] == pytest.approx(90.0)
    assert axes.get_ylabel() == "validation accuracy (%)"


def test_an_existing_tuning_run_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    summary = tmp_path / "out" / "tuning.json"
    summary.write_text('{"kept": true}')
    code, output = _tune(tmp_path, "--tuning-accounting", "compose")
    assert code == 2 and "already holds a tuning run" in output
    assert summary.read_text() == '{"kept": true}'
