"""Bundled and file-based datasets load offline, split deterministically and report honestly."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dpfy.data import (
    DatasetNotFound,
    IdxFormatError,
    available_datasets,
    idx_datasets,
    load_dataset,
)
from dpfy.data import adult as adult_format
from dpfy.data import datasets as datasets_module
from dpfy.data.idx import read_idx, write_idx
from dpfy.data.preprocessing import Preprocessing, PublicRangeScaler
from dpfy.data.public_ranges import BREAST_CANCER_RANGES

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


def assert_well_formed(data, num_classes: int, shape: tuple[int, ...]) -> None:
    """Both splits: float32 features of the declared shape, int64 labels within range."""
    assert data.num_classes == num_classes
    assert data.input_shape == shape
    for split in (data.train, data.test):
        x, y = split.tensors
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape[1:] == shape and len(x) == len(y) > 0
        assert int(y.min()) >= 0 and int(y.max()) < num_classes
        assert torch.isfinite(x).all()


# --------------------------------------------------------------------------- registry


def test_available_datasets_lists_every_loader_with_a_description():
    names = available_datasets()
    assert set(names) == {"digits", "breast-cancer", "fashion-mnist", "mnist", "adult"}
    assert all(isinstance(text, str) and text for text in names.values())


def test_unknown_name_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown dataset 'cifar'.*breast-cancer, digits"):
        load_dataset("cifar")


@pytest.mark.parametrize("limit", [0, -3, 2.5, True])
def test_bad_limit_is_refused(limit):
    with pytest.raises(ValueError, match="limit"):
        load_dataset("digits", limit=limit)


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):
        datasets_module.register_dataset("digits", "again")(lambda options: None)


# --------------------------------------------------------------------------- digits


def test_digits_shapes_split_and_public_scaling():
    data = load_dataset("digits")
    assert_well_formed(data, 10, (1, 8, 8))
    assert (len(data.train), len(data.test)) == (1437, 360)
    x = data.train.tensors[0]
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0  # pixel / 16, values 0..16
    assert data.preprocessing.fitted_on_private_data is False
    assert data.preprocessing.is_pitfall is False
    assert "load_digits" in data.source and "seed 0" in data.split


def test_digits_split_is_deterministic_and_stratified():
    first, second = load_dataset("digits"), load_dataset("digits")
    for a, b in zip(first.train.tensors + first.test.tensors,
                    second.train.tensors + second.test.tensors, strict=True):  # fmt: skip
        assert torch.equal(a, b)
    test_counts = torch.bincount(first.test.tensors[1], minlength=10)
    assert int(test_counts.min()) >= 35 and int(test_counts.max()) <= 37  # ≈ 20% of ≈ 180 each


def test_digits_features_and_labels_stay_aligned():
    """Nearest class centroid learns the split (≈ 90%); misaligned labels would give ≈ 10%."""
    data = load_dataset("digits")
    x, y = data.train.tensors
    centroids = torch.stack([x[y == k].flatten(1).mean(0) for k in range(10)])
    x_test, y_test = data.test.tensors
    predicted = torch.cdist(x_test.flatten(1), centroids).argmin(1)
    assert (predicted == y_test).float().mean() > 0.85


def test_limit_keeps_the_first_examples_of_each_split():
    full, small = load_dataset("digits"), load_dataset("digits", limit=50)
    assert (len(small.train), len(small.test)) == (50, 50)
    assert torch.equal(small.train.tensors[0], full.train.tensors[0][:50])
    assert "first 50" in small.split


def test_summary_is_json_ready():
    summary = json.loads(json.dumps(load_dataset("digits", limit=10).to_dict()))
    assert summary["train_size"] == 10 and summary["input_shape"] == [1, 8, 8]
    assert summary["preprocessing"]["pitfall"] is False


# --------------------------------------------------------------------------- breast cancer


def test_breast_cancer_is_scaled_by_published_ranges_and_nothing_is_fitted():
    data = load_dataset("breast-cancer")
    assert_well_formed(data, 2, (30,))
    assert (len(data.train), len(data.test)) == (455, 114)
    x = data.train.tensors[0]
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    assert data.preprocessing.fitted_on_private_data is False
    assert data.preprocessing.is_pitfall is False
    assert "public bounds" in data.preprocessing.steps[0]
    assert data.class_names == ("malignant", "benign")


def test_breast_cancer_scaling_depends_on_no_row_of_the_training_split():
    raw = load_dataset("breast-cancer", standardize=False)
    scaled = load_dataset("breast-cancer", limit=50)  # other training rows, same map
    scaler = PublicRangeScaler.from_ranges(BREAST_CANCER_RANGES)
    expected = scaler(raw.test.tensors[0].double().numpy()[:50])
    torch.testing.assert_close(scaled.test.tensors[0].double(), torch.from_numpy(expected),
                               atol=1e-6, rtol=0)  # fmt: skip


def test_breast_cancer_ranges_are_the_published_min_and_max():
    from sklearn.datasets import load_breast_cancer

    rows = load_breast_cancer().data
    low, high = np.array(BREAST_CANCER_RANGES).T
    # the published bounds are the rows' min and max, rounded to the digits the description prints
    np.testing.assert_allclose(rows.min(0), low, rtol=0.01, atol=5e-4)
    np.testing.assert_allclose(rows.max(0), high, rtol=0.01, atol=5e-4)


def test_public_range_scaler_maps_the_bounds_to_minus_one_and_one_and_clips():
    scaler = PublicRangeScaler.from_ranges(((0.0, 10.0), (1.0, 99.0)))
    out = scaler(np.array([[0.0, 1.0], [10.0, 99.0], [-5.0, 1e6]]))
    np.testing.assert_allclose(out, [[-1, -1], [1, 1], [-1, 1]], atol=1e-12)
    with pytest.raises(ValueError, match="low < high"):
        PublicRangeScaler.from_ranges(((3.0, 3.0),))


def test_skipping_or_declaring_public_changes_the_flags_truthfully():
    raw = load_dataset("breast-cancer", standardize=False)
    assert raw.preprocessing.fitted_on_private_data is False and not raw.preprocessing.is_pitfall
    assert float(raw.train.tensors[0].max()) > 100  # raw areas, untouched
    declared = load_dataset("breast-cancer", declare_public=True)
    assert declared.preprocessing.declared_public is True
    assert declared.preprocessing.is_pitfall is False


def test_preprocessing_record_is_frozen():
    record = Preprocessing(steps=("x",), fitted_on_private_data=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.fitted_on_private_data = False  # type: ignore[misc]


# --------------------------------------------------------------------------- IDX reader


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
def test_idx_round_trip(tmp_path, suffix, dtype):
    rng = np.random.default_rng(0)
    array = (rng.normal(size=(5, 3, 4)) * 50).astype(dtype)
    path = write_idx(tmp_path / f"a.idx{suffix}", array)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == (suffix == ".gz")
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, array)
    assert np.array_equal(read_idx(path, limit=2), array[:2])


def test_idx_reader_detects_gzip_by_content_not_name(tmp_path):
    array = np.arange(6, dtype=np.uint8)
    path = write_idx(tmp_path / "labels-idx1-ubyte", array, compress=True)
    assert np.array_equal(read_idx(path), array)


def test_idx_header_layout_is_the_standard_one(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros((2, 3), dtype=np.uint8))
    assert path.read_bytes()[:12] == bytes([0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3])


def corrupt(path: Path, data: bytes, compressed: bool) -> Path:
    """Write ``data`` (optionally gzipped) to ``path``."""
    path.write_bytes(gzip.compress(data) if compressed else data)
    return path


@pytest.mark.parametrize("compressed", [False, True])
def test_idx_bad_magic_is_refused(tmp_path, compressed):
    path = corrupt(tmp_path / "bad", b"\x08\x03\x00\x00" + bytes(20), compressed)
    with pytest.raises(IdxFormatError, match=r"not an IDX file.*magic"):
        read_idx(path)


@pytest.mark.parametrize("compressed", [False, True])
def test_idx_truncated_data_is_refused(tmp_path, compressed):
    full = write_idx(tmp_path / "full", np.ones((4, 5), dtype=np.uint8)).read_bytes()
    path = corrupt(tmp_path / "short", full[:-3], compressed)
    with pytest.raises(IdxFormatError, match=r"truncated.*20 bytes.*found 17"):
        read_idx(path)


def test_idx_truncated_header_and_trailing_bytes_are_refused(tmp_path):
    full = write_idx(tmp_path / "full", np.ones((4, 5), dtype=np.uint8)).read_bytes()
    with pytest.raises(IdxFormatError, match="truncated header"):
        read_idx(corrupt(tmp_path / "h", full[:6], False))
    with pytest.raises(IdxFormatError, match="trailing bytes"):
        read_idx(corrupt(tmp_path / "t", full + b"\x00", False))


def test_idx_broken_gzip_stream_is_refused(tmp_path):
    packed = gzip.compress(write_idx(tmp_path / "f", np.ones(1000, dtype=np.uint8)).read_bytes())
    path = tmp_path / "broken.gz"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(IdxFormatError, match=r"broken\.gz"):
        read_idx(path)


def test_idx_writer_refuses_unsupported_dtypes(tmp_path):
    with pytest.raises(ValueError, match="cannot store dtype int64"):
        write_idx(tmp_path / "x", np.zeros(3, dtype=np.int64))


# --------------------------------------------------------------------------- MNIST-style IDX


def fake_idx_dir(directory: Path, *, n_train=12, n_test=5, gz=True, dotted=False) -> dict:
    """A fake MNIST-style directory with random images and labels under the standard names."""
    rng = np.random.default_rng(1)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        sep = "." if dotted else "-"
        ext = ".gz" if gz else ""
        write_idx(directory / f"{prefix}-images{sep}idx3-ubyte{ext}", images)
        write_idx(directory / f"{prefix}-labels{sep}idx1-ubyte{ext}", labels)
        arrays[prefix] = (images, labels)
    return arrays


@pytest.mark.parametrize(("gz", "dotted"), [(True, False), (False, False), (False, True)])
def test_fashion_mnist_from_a_data_dir(tmp_path, gz, dotted):
    arrays = fake_idx_dir(tmp_path / "fm", gz=gz, dotted=dotted)
    data = load_dataset("fashion-mnist", data_dir=tmp_path / "fm")
    assert_well_formed(data, 10, (1, 28, 28))
    assert (len(data.train), len(data.test)) == (12, 5)
    for split, prefix in ((data.train, "train"), (data.test, "t10k")):
        images, labels = arrays[prefix]
        pixels = (split.tensors[0].squeeze(1).double() * 0.3530 + 0.2860) * 255
        np.testing.assert_allclose(pixels.numpy(), images, atol=1e-3)
        assert np.array_equal(split.tensors[1].numpy(), labels)
    assert data.preprocessing.fitted_on_private_data is False
    assert str(tmp_path / "fm") in data.source


def test_idx_scaling_without_standardisation_is_pixel_over_255(tmp_path):
    arrays = fake_idx_dir(tmp_path / "m")
    data = load_dataset("mnist", data_dir=tmp_path / "m", standardize=False, limit=3)
    expected = arrays["train"][0][:3] / 255.0
    np.testing.assert_allclose(data.train.tensors[0].squeeze(1).numpy(), expected, atol=1e-6)
    assert data.preprocessing.steps == ("pixel / 255 (fixed constant)",)


def test_missing_fashion_mnist_names_the_package_and_the_path(tmp_path, monkeypatch):
    spec = dataclasses.replace(idx_datasets._FASHION, default_dirs=(tmp_path / "none",))
    monkeypatch.setattr(idx_datasets, "_FASHION", spec)
    with pytest.raises(DatasetNotFound) as caught:
        load_dataset("fashion-mnist")
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert "apt-get install dataset-fashion-mnist" in message
    assert str(tmp_path / "none") in message and "--data-dir" in message
    assert "train-images-idx3-ubyte.gz" in message


def test_a_data_dir_missing_one_file_says_which(tmp_path):
    fake_idx_dir(tmp_path / "fm")
    (tmp_path / "fm" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFound, match=r"missing t10k-labels-idx1-ubyte.gz\)"):
        load_dataset("fashion-mnist", data_dir=tmp_path / "fm")


def test_missing_mnist_says_no_debian_package_ships_it(tmp_path):
    with pytest.raises(DatasetNotFound, match="No Debian package ships MNIST"):
        load_dataset("mnist", data_dir=tmp_path)


def test_corrupt_or_inconsistent_idx_files_are_refused(tmp_path):
    fake_idx_dir(tmp_path / "a")
    (tmp_path / "a" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08"))
    with pytest.raises(IdxFormatError, match="train-images"):
        load_dataset("mnist", data_dir=tmp_path / "a")
    fake_idx_dir(tmp_path / "b")
    write_idx(tmp_path / "b" / "train-labels-idx1-ubyte.gz", np.full(12, 10, dtype=np.uint8))
    with pytest.raises(ValueError, match="label above 9"):
        load_dataset("mnist", data_dir=tmp_path / "b")
    fake_idx_dir(tmp_path / "c")
    write_idx(tmp_path / "c" / "t10k-labels-idx1-ubyte.gz", np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="5 images but 4 labels"):
        load_dataset("mnist", data_dir=tmp_path / "c")


@pytest.mark.slow
@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_from_the_debian_package():
    data = load_dataset("fashion-mnist")
    assert_well_formed(data, 10, (1, 28, 28))
    assert (len(data.train), len(data.test)) == (60_000, 10_000)
    assert torch.bincount(data.train.tensors[1]).tolist() == [6000] * 10
    x = data.train.tensors[0]
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01  # published constants
    assert str(FASHION_DIR) in data.source and "dataset-fashion-mnist" in data.source


# --------------------------------------------------------------------------- UCI Adult

ROWS = [
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, "
    "Male, 2174, 0, 40, United-States, <=50K",
    "50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, Husband, "
    "White, Male, 0, 0, 13, United-States, >50K",
    "38, ?, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, Black, Female, 0, 0, "
    "40, Mars, <=50K",
    "53, Private, 234721, 11th, 7, Married-civ-spouse, Handlers-cleaners, Husband, Black, Male, "
    "0, 0, 40, United-States, >50K",
]


def synthetic_rows(n: int, seed: int = 0) -> list[str]:
    """``n`` rows in the UCI adult.data format, the fixed ones above first."""
    rng = np.random.default_rng(seed)
    rows = list(ROWS)
    while len(rows) < n:
        pick = {a: rng.choice(v) for a, v in adult_format.CATEGORIES.items()}
        values = [
            str(rng.integers(17, 90)), pick["workclass"], str(rng.integers(10**4, 10**6)),
            pick["education"], str(rng.integers(1, 17)), pick["marital-status"],
            pick["occupation"], pick["relationship"], pick["race"], pick["sex"],
            str(rng.integers(0, 5000)), str(rng.integers(0, 2000)), str(rng.integers(1, 99)),
            pick["native-country"], rng.choice(["<=50K", ">50K"]),
        ]  # fmt: skip
        rows.append(", ".join(values))
    return rows[:n]


def write_uci(directory: Path, n_train: int = 40, n_test: int = 10) -> Path:
    """adult.data and adult.test in the UCI layout (test: header line, labels ending in '.')."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adult.data").write_text("\n".join(synthetic_rows(n_train)) + "\n\n")
    test = [f"{row}." for row in synthetic_rows(n_test, seed=1)]
    (directory / "adult.test").write_text("|1x3 Cross validator\n" + "\n".join(test) + "\n")
    return directory


def block(x: torch.Tensor, attribute: str) -> torch.Tensor:
    """The one-hot columns of ``attribute`` in the encoded features."""
    names = adult_format.feature_names()
    columns = [i for i, name in enumerate(names) if name.startswith(f"{attribute}=")]
    return x[:, columns]


def test_adult_from_uci_files_uses_the_public_vocabulary(tmp_path):
    data = load_dataset("adult", data_dir=write_uci(tmp_path / "adult"))
    assert_well_formed(data, 2, (105,))
    assert (len(data.train), len(data.test)) == (40, 10)
    assert data.train.tensors[1][:4].tolist() == [0, 1, 0, 1]
    x = data.train.tensors[0]
    names = adult_format.feature_names()
    assert x[0, names.index("workclass=State-gov")] == 1
    assert x[1, names.index("occupation=Exec-managerial")] == 1
    assert block(x, "workclass")[0].sum() == 1
    assert "adult.data" in data.source and "adult.test" in data.split


def test_adult_unknown_and_missing_categories_encode_as_zeros(tmp_path):
    data = load_dataset("adult", data_dir=write_uci(tmp_path / "adult"))
    x = data.train.tensors[0]
    assert block(x, "workclass")[2].sum() == 0  # '?'
    assert block(x, "native-country")[2].sum() == 0  # 'Mars' is not a UCI value
    assert block(x, "race")[2].sum() == 1  # the rest of the row is encoded as usual


def test_adult_vocabulary_does_not_depend_on_the_rows(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "adult.data").write_text("\n".join(ROWS[:2] * 5) + "\n")
    data = load_dataset("adult", data_dir=tmp_path / "one")
    assert data.input_shape == (105,)
    assert "public UCI attribute values" in data.preprocessing.steps[0]


def test_adult_scales_only_numeric_columns_and_records_it(tmp_path):
    data = load_dataset("adult", data_dir=write_uci(tmp_path / "adult"))
    x = data.train.tensors[0].double()
    assert float(x[:, :6].min()) >= -1.0 and float(x[:, :6].max()) <= 1.0
    assert set(x[:, 6:].unique().tolist()) == {0.0, 1.0}
    assert not data.preprocessing.fitted_on_private_data and not data.preprocessing.is_pitfall
    assert "census coding" in data.preprocessing.steps[-1]
    raw = load_dataset("adult", data_dir=tmp_path / "adult", standardize=False)
    assert raw.train.tensors[0][0, :6].tolist() == [39, 77516, 13, 2174, 0, 40]
    assert not raw.preprocessing.fitted_on_private_data


def test_adult_csv_with_header_and_aliases(tmp_path):
    header = (
        "age,workclass,fnlwgt,education,educational-num,marital-status,occupation,"
        "relationship,race,gender,capital-gain,capital-loss,hours-per-week,native-country,income"
    )
    rows = [row.replace(", ", ",") for row in synthetic_rows(50)]
    path = tmp_path / "adult.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    data = load_dataset("adult", data_dir=path)
    assert (len(data.train), len(data.test)) == (40, 10)
    assert "stratified" in data.split
    assert len(load_dataset("adult", data_dir=tmp_path).train) == 40  # adult.csv in a directory


def test_adult_without_data_says_how_to_provide_it(tmp_path):
    with pytest.raises(DatasetNotFound, match=r"no bundled copy.*adult\.data.*income"):
        load_dataset("adult")
    with pytest.raises(DatasetNotFound, match=re.escape(f"adult not found in {tmp_path}")):
        load_dataset("adult", data_dir=tmp_path)


def test_adult_malformed_files_are_refused(tmp_path):
    bad_label = tmp_path / "a.data"
    bad_label.write_text(ROWS[0].replace("<=50K", "rich") + "\n")
    with pytest.raises(adult_format.AdultFormatError, match="income must be"):
        load_dataset("adult", data_dir=bad_label)
    short = tmp_path / "b.data"
    short.write_text("39, State-gov, 77516\n")
    with pytest.raises(adult_format.AdultFormatError, match="3 fields, expected 15"):
        load_dataset("adult", data_dir=short)
    no_income = tmp_path / "c.csv"
    no_income.write_text("age,income\n39,<=50K\n")
    with pytest.raises(adult_format.AdultFormatError, match="missing column"):
        load_dataset("adult", data_dir=no_income)
