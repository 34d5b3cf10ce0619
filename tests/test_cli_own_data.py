"""`dpfy train --data FILE --label COLUMN`: the user's own CSV / NPZ, with the features' scale
declared public (or the fitted scale flagged), the model chosen from the data's shape, the card
naming the file and what was declared public, and a bad file refused in one line naming the row
and column."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.data.user_file import load_user_file, model_for_shape, peek_input_shape

QUICK = ["train", "--epochs", "1", "--batch-size", "32"]


def dpfy(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def write_csv(path: Path, rows: int = 120, seed: int = 0) -> Path:
    """Four numeric features in [0, 10] and a yes/no label that depends on two of them."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 10, (rows, 4))
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["a", "b", "c", "d", "target"])
        for row in x:
            writer.writerow([f"{v:.4f}" for v in row] + ["yes" if row[0] + row[1] > 10 else "no"])
    return path


def write_npz(path: Path, rows: int = 90) -> Path:
    rng = np.random.default_rng(1)
    np.savez(path, x=rng.uniform(0, 255, (rows, 12, 12)), y=rng.integers(0, 3, rows))
    return path


# ------------------------------------------------------------------ end to end


def test_a_csv_trains_and_the_card_names_the_file_and_what_was_declared_public(tmp_path):
    data = write_csv(tmp_path / "patients.csv")
    out = tmp_path / "run"
    code, stdout, stderr = dpfy(
        *QUICK, "--data", str(data), "--label", "target", "--feature-bounds", "0:10",
        "--out", str(out), "--json",
    )  # fmt: skip
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["status"] == "finished" and 0 <= result["test_accuracy"] <= 1
    card = (out / "report.md").read_text()
    assert f"Dataset: patients.csv, N = 96, from {data.resolve()}" in card
    assert "labels from the column 'target'" in card
    assert "bounds declared public by the user (0..10 for every feature)" in card
    assert "fitted on the private data" not in card
    saved = json.loads((out / "config.json").read_text())
    assert saved["data"] == str(data) and saved["label"] == "target" and saved["model"] == "mlp"


def test_images_in_an_npz_get_a_cnn_unless_a_model_is_given(tmp_path):
    data = write_npz(tmp_path / "images.npz")
    assert peek_input_shape(data, "y") == (1, 12, 12)
    assert model_for_shape((1, 12, 12)) == "cnn" and model_for_shape((4,)) == "mlp"
    out = tmp_path / "run"
    code, _, stderr = dpfy(
        *QUICK, "--data", str(data), "--label", "y", "--feature-bounds", "0:255",
        "--out", str(out), "--quiet",
    )  # fmt: skip
    assert code == 0, stderr
    assert json.loads((out / "config.json").read_text())["model"] == "cnn"
    assert "Model: cnn" in (out / "report.md").read_text()


def test_own_data_without_a_declared_scale_is_refused_before_any_directory(tmp_path):
    data = write_csv(tmp_path / "d.csv")
    code, _, stderr = dpfy(*QUICK, "--data", str(data), "--label", "target",
                           "--out", str(tmp_path / "run"))  # fmt: skip
    line = one_error_line(stderr)
    assert code == 2 and "--feature-bounds" in line and "fit" in line and "LOW:HIGH" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--label", "nope", "--feature-bounds", "0:10"], "no column 'nope'"),
        (["--feature-bounds", "0:10"], "--label COLUMN"),
        (["--label", "target", "--feature-bounds", "10:0"], "low < high"),
        (["--label", "target", "--feature-bounds", "0:10", "--dataset", "digits"], "not both"),
        (["--label", "target", "--feature-bounds", "0:10", "--access", "label"], "--access full"),
    ],
    ids=["unknown-label", "no-label", "bad-bounds", "dataset-too", "access"],
)
def test_own_data_options_are_checked_in_one_line(tmp_path, extra, named):
    data = write_csv(tmp_path / "d.csv")
    code, _, stderr = dpfy(*QUICK, "--data", str(data), *extra, "--out", str(tmp_path / "r"))
    assert code == 2 and named in one_error_line(stderr)
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ bad files


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("a,b,y\n1,2,x\n3,,z\n", "row 3, column 'b': an empty cell"),
        ("a,b,y\n1,2,x\n3,abc,z\n", "row 3, column 'b': 'abc' is not a number"),
        ("a,b,y\n1,2,x\n3,4\n", "row 3 has 2 cells, the header 3"),
        ("a,b,y\n1,nan,x\n2,3,z\n", "row 2, column 'b': 'nan' is not a finite number"),
        ("a,b,y\n1,2,x\n2,3,\n", "row 3, column 'y': the label is empty"),
    ],
    ids=["empty-cell", "text", "short-row", "nan", "no-label"],
)
def test_a_bad_csv_is_refused_in_one_line_naming_row_and_column(tmp_path, text, named):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    code, _, stderr = dpfy(*QUICK, "--data", str(path), "--label", "y",
                           "--feature-bounds", "0:1", "--out", str(tmp_path / "r"))  # fmt: skip
    line = one_error_line(stderr)
    assert code == 2 and named in line and str(path) in line


def test_a_non_finite_npz_feature_is_named_by_row_and_feature(tmp_path):
    x = np.zeros((10, 3))
    x[7, 2] = np.inf
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(10) % 2)
    with pytest.raises(ValueError, match=r"row 7, feature 2 of 'x' is inf"):
        load_user_file(tmp_path / "d.npz", "y", "0:1")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="pip install pyarrow`, or save the table as CSV or NPZ"):
        load_user_file(path, "y", "0:1")


# ------------------------------------------------------------------ the declared scale


def test_declared_bounds_clip_and_scale_each_row_alone(tmp_path):
    """Bounds are constants: a row's features do not move when another row changes."""
    first = write_csv(tmp_path / "one.csv")
    rows = list(csv.reader(first.open()))
    rows[-1][0] = "1000"  # an outlier in another row
    second = tmp_path / "two.csv"
    with second.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    one, two = (load_user_file(p, "target", "0:10") for p in (first, second))
    x1, x2 = one.train.tensors[0], two.train.tensors[0]
    assert float(x1.min()) >= -1 and float(x1.max()) <= 1
    assert float(x2.max()) == pytest.approx(1.0)  # the outlier is clipped to its bound
    changed = (x1 != x2).any(dim=1)
    assert int(changed.sum()) <= 1  # only the outlier's own row (if it is in training)
    assert not one.preprocessing.is_pitfall


def test_a_bounds_file_gives_each_column_its_range_and_names_a_missing_one(tmp_path):
    data = write_csv(tmp_path / "d.csv")
    bounds = tmp_path / "bounds.json"
    bounds.write_text(json.dumps({"a": [0, 10], "b": [0, 10], "c": [0, 20], "d": [5, 10]}))
    loaded = load_user_file(data, "target", str(bounds))
    x = loaded.train.tensors[0]
    assert float(x[:, 2].max()) <= 0.0 + 1e-6  # c ≤ 10 is the lower half of [0, 20]
    assert float(x[:, 3].min()) == pytest.approx(-1.0)  # d < 5 is clipped to its low bound
    bounds.write_text(json.dumps({"a": [0, 10], "b": [0, 10]}))
    with pytest.raises(ValueError, match="no range for c, d"):
        load_user_file(data, "target", str(bounds))


def test_fitting_the_scale_on_the_file_is_flagged_as_fitted_on_private_data(tmp_path):
    data = write_csv(tmp_path / "d.csv")
    fitted = load_user_file(data, "target", "fit")
    assert fitted.preprocessing.fitted_on_private_data and fitted.preprocessing.is_pitfall
    as_is = load_user_file(data, "target", "as-is")
    assert not as_is.preprocessing.is_pitfall
    assert float(as_is.train.tensors[0].max()) > 1  # used unchanged


def test_test_rows_with_a_label_training_never_saw_are_refused(tmp_path):
    train = tmp_path / "train.csv"
    train.write_text("a,y\n1,x\n2,x\n3,z\n4,z\n")
    test = tmp_path / "test.csv"
    test.write_text("a,y\n1,x\n2,w\n")
    with pytest.raises(ValueError, match="label 'w', which no training row has"):
        load_user_file(train, "y", "0:5", test_path=test)
    loaded = load_user_file(train, "y", "0:5", test_path=train)
    assert loaded.class_names == ("x", "z") and len(loaded.test) == 4


def _image_folder(root: Path, size: int = 10) -> Path:
    from PIL import Image

    rng = np.random.default_rng(2)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(5):
            pixels = rng.integers(0, 255, (size, size), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_a_folder_of_class_subfolders_is_images_labelled_by_subfolder(tmp_path):
    folder = _image_folder(tmp_path / "pets")
    assert peek_input_shape(folder, "") == (1, 10, 10)
    loaded = load_user_file(folder, "", "0:255")
    assert loaded.class_names == ("cat", "dog") and loaded.input_shape == (1, 10, 10)
    assert len(loaded.train) + len(loaded.test) == 10
    assert "labels from the class subfolder names" in loaded.source
    from PIL import Image

    Image.new("L", (12, 10)).save(folder / "dog" / "odd.png")
    with pytest.raises(ValueError, match=r"odd.png is 12×10, the first image 10×10; resize"):
        load_user_file(folder, "", "0:255")


def test_the_help_shows_the_bounds_file_format_whole():
    code, stdout, _ = dpfy_wide("train", "--help")
    assert code == 0 and "FILE.json ({column: [low, high]})" in " ".join(stdout.split())


def dpfy_wide(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
    return result.exit_code, result.stdout, result.stderr


def test_a_black_box_audit_of_an_own_data_run_retrains_on_that_file(tmp_path):
    data = write_csv(tmp_path / "patients.csv", rows=400)
    out = tmp_path / "run"
    code, _, stderr = dpfy(
        *QUICK, "--data", str(data), "--label", "target", "--feature-bounds", "0:10",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    code, _, stderr = dpfy(
        "audit", str(out), "--method", "black-box", "--canaries", "100", "--seed", "0"
    )
    assert code == 0, stderr
    audit = json.loads((out / "audit.json").read_text())["audits"][-1]
    assert audit["threat_model"] == "black-box" and audit["scope"] == "re-trained-run"


def test_the_card_counts_the_label_classes_but_never_prints_their_private_values(tmp_path):
    rows = ["a,b,diagnosis"] + [
        f"{i % 7},{i % 5},{'flu' if i % 2 else 'healthy'}" for i in range(60)
    ]
    rows += ["3,3,patient-4711-rare", "4,1,patient-4711-rare"]
    data = tmp_path / "visits.csv"
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    code, _, stderr = dpfy(
        *QUICK, "--data", str(data), "--label", "diagnosis", "--feature-bounds", "0:10",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    published = (out / "report.md").read_text() + (out / "report.json").read_text()
    assert "3 distinct" in published
    assert "4711" not in published and "healthy" not in published


def test_the_card_says_the_test_rows_are_private_rows_of_the_same_file(tmp_path):
    data = write_csv(tmp_path / "patients.csv")
    out = tmp_path / "run"
    code, _, stderr = dpfy(
        *QUICK, "--data", str(data), "--label", "target", "--feature-bounds", "0:10",
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, stderr
    card = " ".join((out / "report.md").read_text().split())
    assert "private rows of the same file" in card and "outside the guarantee" in card
