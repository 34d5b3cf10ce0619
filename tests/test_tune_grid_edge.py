"""A tuned value at the edge of its grid is flagged: one warning per parameter naming the value
and the fix (extend the grid), printed by the CLI and kept in tuning.json."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.tune.clip_search import ClipChoice, ClipSearch
from dpfy.tune.grid_edge import TuningGridEdgeWarning, grid_edges, search_edges
from dpfy.tune.pipeline import TuneConfig, run_tuning
from dpfy.tune.sweep import LrClipSweep
from dpfy.tune.trial import TrialConfig


def _chosen(lr: float, clip: float) -> TrialConfig:
    return TrialConfig(max_grad_norm=clip, lr=lr, noise_multiplier=1.0)


def test_a_value_at_either_end_of_its_grid_is_an_edge_and_a_middle_one_is_not() -> None:
    grid = (0.01, 0.1, 1.0)
    assert [e.value for e in grid_edges([("learning rate", "--lr-grid", grid, 1.0)])] == [1.0]
    assert [e.value for e in grid_edges([("learning rate", "--lr-grid", grid, 0.01)])] == [0.01]
    assert grid_edges([("learning rate", "--lr-grid", grid, 0.1)]) == []
    assert grid_edges([("learning rate", "--lr-grid", (0.1,), 0.1)]) == []  # nothing to extend


def test_the_message_names_the_parameter_the_value_and_which_way_to_extend() -> None:
    (high,) = grid_edges([("learning rate", "--lr-grid", (0.01, 0.1), 0.1)])
    assert "learning rate = 0.1" in high.message() and "largest" in high.message()
    assert "extend --lr-grid above 0.1" in high.message()
    (low,) = grid_edges([("clip norm C", "--clip-grid", (0.3, 1.0, 3.0), 0.3)])
    assert "extend --clip-grid below 0.3" in low.message() and "smallest" in low.message()
    assert "\n" not in low.message()


def test_an_lr_clip_corner_flags_both_parameters_and_an_edge_row_only_one() -> None:
    sweep = LrClipSweep(lrs=(0.01, 0.1, 1.0), clips=(0.3, 1.0, 3.0))
    corner = search_edges(sweep, _chosen(1.0, 3.0), None)
    assert [e.parameter for e in corner] == ["learning rate", "clip norm C"]
    assert [e.parameter for e in search_edges(sweep, _chosen(1.0, 1.0), None)] == ["learning rate"]
    assert search_edges(sweep, _chosen(0.1, 1.0), None) == []


def test_clip_search_is_flagged_unless_its_trials_could_not_tell_the_clip_norms_apart() -> None:
    search = ClipSearch(grid=(0.3, 1.0, 3.0), noise_multiplier=1.0)
    distinct = ClipChoice(3.0, {0.3: 0.5, 1.0: 0.7, 3.0: 0.9}, 0.9, 0.02, {})
    assert [e.value for e in search_edges(search, _chosen(0.01, 3.0), distinct)] == [3.0]
    flat = ClipChoice(0.3, {0.3: 0.9, 1.0: 0.9, 3.0: 0.9}, 0.9, 0.02, {})
    assert search_edges(search, _chosen(0.01, 0.3), flat) == []  # a note says so already


def test_an_lr_clip_tuning_at_a_grid_corner_warns_and_records_it(tmp_path: Path) -> None:
    config = TuneConfig(
        search="lr-clip", accounting="compose", lr_grid=(0.01, 0.1), clip_grid=(0.3, 3.0),
        out=tmp_path / "tune", seed=0, limit=400, epochs=1, trial_epochs=0.5,
        compare_default=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run_tuning(config).summary
    edges = [str(w.message) for w in caught if issubclass(w.category, TuningGridEdgeWarning)]
    assert edges and len(edges) == len(summary["grid_edges"]) == 2  # a 2×2 grid: all corners
    assert any("learning rate = " in e for e in edges)
    assert any("clip norm C = " in e for e in edges)
    stored = json.loads((tmp_path / "tune" / "tuning.json").read_text())
    assert stored["grid_edges"] == edges
    report = json.loads((tmp_path / "tune" / "final" / "report.json").read_text())
    flagged = [p for p in report["pitfalls"] if p["code"] == "tuning-grid-edge"]
    assert len(flagged) == 1 and all(e in flagged[0]["evidence"] for e in edges)


@pytest.mark.filterwarnings("ignore::dpfy.tune.grid_edge.TuningGridEdgeWarning")
def test_the_cli_prints_a_grid_edge_as_a_one_line_warning(tmp_path: Path) -> None:
    args = [
        "tune", "--search", "lr-clip", "--tuning-accounting", "compose", "--lr-grid", "0.01,0.1",
        "--clip-grid", "1", "--epochs", "1", "--trial-epochs", "0.5", "--seed", "0",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    assert any("learning rate = " in line and "extend --lr-grid" in line for line in lines)
    assert not any("clip norm C = " in line for line in lines)  # a one-value grid is fixed
