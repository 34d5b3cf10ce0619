"""Issue 35, item 1: non-finite features are refused at load, naming the file, column and row —
on every loader path (train, the access models, federated) — and a failing DP-SGD step leaves the
run directory "failed", with what was written intact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.test_datasets import synthetic_rows
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.data import datasets as datasets_module
from dpfy.data.datasets import load_dataset
from dpfy.data.idx import write_idx
from dpfy.data.loaded_dataset import LoadedDataset, refuse_non_finite


def dpfy(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def adult_with_nan_age(directory: Path, n: int = 40) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = synthetic_rows(n)
    rows[7] = "nan" + rows[7][rows[7].index(",") :]  # age of data row 8
    (directory / "adult.data").write_text("\n".join(rows) + "\n")
    return directory


def test_a_nan_adult_feature_is_refused_naming_file_row_and_column(tmp_path):
    directory = adult_with_nan_age(tmp_path / "adult")
    with pytest.raises(ValueError, match=r"adult\.data, data row 8, column age: 'nan'"):
        load_dataset("adult", data_dir=directory)


def test_an_infinite_adult_feature_in_the_test_file_is_refused(tmp_path):
    directory = tmp_path / "adult"
    directory.mkdir()
    (directory / "adult.data").write_text("\n".join(synthetic_rows(40)) + "\n")
    rows = [f"{row}." for row in synthetic_rows(10, seed=1)]
    parts = rows[2].split(", ")
    parts[12] = "inf"  # hours-per-week
    rows[2] = ", ".join(parts)
    (directory / "adult.test").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"adult\.test, data row 3, column hours-per-week"):
        load_dataset("adult", data_dir=directory)


def fake_float_mnist(directory: Path, *, nan_in: str) -> Path:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", 12), ("t10k", 5)):
        images = rng.random((n, 28, 28)).astype(np.float32) * 255
        if prefix == nan_in:
            images[3, 2, 5] = np.nan
        write_idx(directory / f"{prefix}-images-idx3-ubyte", images)
        write_idx(
            directory / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n).astype(np.uint8)
        )
    return directory


@pytest.mark.parametrize("split", ["train", "t10k"])
def test_nan_pixels_in_an_idx_file_are_refused_naming_the_file(tmp_path, split):
    directory = fake_float_mnist(tmp_path / "mnist", nan_in=split)
    with pytest.raises(ValueError, match=rf"{split}-images-idx3-ubyte: row 3, column {2 * 28 + 5}"):
        load_dataset("mnist", data_dir=directory)


def test_the_helper_names_the_first_bad_value_and_counts_the_rest():
    x = np.zeros((4, 3))
    x[2, 1] = np.inf
    x[3, 0] = np.nan
    with pytest.raises(ValueError, match=r"f\.csv: row 3, column b holds inf.*2 non-finite"):
        refuse_non_finite(x, "f.csv", ("a", "b", "c"))
    refuse_non_finite(np.zeros((2, 2), dtype=np.uint8), "ints")  # integers are always finite


@pytest.fixture
def nan_digits(monkeypatch):
    """A registered loader (as a user's would be) whose training images are all NaN."""
    real = datasets_module._REGISTRY["digits"]

    def load(options):
        data: LoadedDataset = real.load(options)
        x, y = data.train.tensors
        return LoadedDataset(
            data.name, torch.utils.data.TensorDataset(torch.full_like(x, float("nan")), y),
            data.test, data.num_classes, data.input_shape, data.source, data.preprocessing,
            data.split, data.class_names,
        )  # fmt: skip

    monkeypatch.setitem(
        datasets_module._REGISTRY, "digits", datasets_module.DatasetSpec("digits", "", load)
    )


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--access", "label", "--features-public"],
        ["train", "--access", "prediction"],
        ["federated", "--rounds", "1"],
        ["train", "--epochs", "0.1"],
    ],
    ids=["label", "prediction", "federated", "dp-sgd"],
)
def test_all_nan_training_features_are_refused_on_every_path(nan_digits, tmp_path, command):
    code, _, stderr = dpfy(*command, "--out", str(tmp_path / "run"))
    line = one_error_line(stderr)
    assert code == 2 and "digits training split" in line and "row 1, column 0" in line
    status = tmp_path / "run" / "status.json"
    if status.exists():  # a one-shot job claims its directory first: marked failed, not running
        assert json.loads(status.read_text())["status"] == "failed"
    else:
        assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_failing_private_step_leaves_the_run_failed_with_what_was_written(tmp_path, monkeypatch):
    from dpfy.jobs import loop

    real = loop._step
    calls = {"n": 0}

    def step_then_fail(private, x, y):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("the loss is NaN")
        return real(private, x, y)

    monkeypatch.setattr(loop, "_step", step_then_fail)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--model", "logreg", "--epochs", "1", "--out", str(out)]
    )
    assert result.exit_code != 0
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and status["steps_taken"] == 3
    assert "the loss is NaN" in status["error"]
    assert json.loads((out / "config.json").read_text())["model"] == "logreg"
    assert (out / "checkpoint.pt").is_file()  # the last periodic checkpoint is kept
