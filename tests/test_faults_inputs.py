"""Issue 35, items 4, 5 and 7: every file read bounded and regular-file only; every write-time
OS error one line, exit 2, status "failed", nothing already written touched; every option that
does not apply to the chosen mode, and every string or bool where a number is meant, refused
with one line."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from tests.test_datasets import synthetic_rows
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import dpfy
from dpfy._safe_io import WriteFailed, atomic_write_text, read_json
from dpfy.cli.app import app
from dpfy.data.datasets import load_dataset


def dpfy_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ------------------------------------------------------------------ item 4: bounded reads


def test_config_pointing_at_dev_zero_is_one_line():
    code, _, stderr = dpfy_cli("train", "--config", "/dev/zero")
    assert code == 2 and "is a device, not a regular file" in one_error_line(stderr)


def test_config_pointing_at_a_fifo_is_one_line_not_a_hang(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    code, _, stderr = dpfy_cli("train", "--config", str(fifo))
    assert code == 2 and "FIFO" in one_error_line(stderr)


def test_deeply_nested_json_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    code, _, stderr = dpfy_cli("train", "--config", str(path))
    assert code == 2 and "nested too deeply" in one_error_line(stderr)


def test_an_oversized_json_file_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "big.json"
    with path.open("wb") as handle:
        handle.truncate(5 * 2**20)  # sparse: 5 MiB of zeros
    with pytest.raises(ValueError, match="larger than 1 MiB"):
        read_json(path, "config", limit=2**20)


def test_report_on_a_fifo_facts_file_is_one_line_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "facts.json")
    code, _, stderr = dpfy_cli("report", str(tmp_path))
    assert code == 2 and "FIFO" in one_error_line(stderr)


def test_resume_from_a_fifo_checkpoint_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "checkpoint.pt")
    (tmp_path / "config.json").write_text(json.dumps({"command": "train", "model": "logreg"}))
    (tmp_path / "status.json").write_text(json.dumps({"status": "interrupted"}))
    code, _, stderr = dpfy_cli("train", "--resume", str(tmp_path))
    assert code == 2 and "FIFO" in one_error_line(stderr)


# ------------------------------------------------------------------ item 5: write-time errors


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def torch_writer_failed(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0")


@pytest.mark.parametrize("failure", [disk_full, torch_writer_failed], ids=["oserror", "torch"])
def test_a_full_disk_at_a_checkpoint_is_one_line_and_a_failed_status(
    tmp_path, monkeypatch, failure
):
    from dpfy.train import checkpoints

    out = tmp_path / "run"
    monkeypatch.setattr(checkpoints.torch, "save", failure)
    code, _, stderr = dpfy_cli("train", "--model", "logreg", "--epochs", "1", "--out", str(out))
    line = one_error_line(stderr)
    assert code == 2 and "cannot write" in line and "checkpoint.pt" in line
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed"
    assert json.loads((out / "config.json").read_text())["model"] == "logreg"  # intact
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_atomic_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    target = tmp_path / "status.json"
    target.write_text("old")
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(WriteFailed, match="No space left"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "status.json"
    ]


def test_atomic_writes_fsync_before_the_rename(tmp_path, monkeypatch):
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append("rename"), real_replace(a, b))[1])
    atomic_write_text(tmp_path / "f", "x")
    assert order[:2] == ["fsync", "rename"]


def test_audit_blocks_beyond_any_memory_is_one_line(tmp_path):
    code, _, stderr = dpfy_cli("audit", str(tmp_path), "--blocks", str(10**12))
    assert code == 2 and "--blocks must be at most" in one_error_line(stderr)


def test_audit_seed_minus_one_is_one_line(tmp_path):
    code, _, stderr = dpfy_cli("audit", str(tmp_path), "--seed", "-1")
    assert code == 2 and "seed" in one_error_line(stderr)


# ------------------------------------------------------------------ item 7: silently accepted


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--max-user-examples", "3"], "--max-examples-per-user"),
        (["--label-mechanism", "rr-prior"], "--label-mechanism applies to --access label"),
        (["--features-public"], "--features-public applies to --access label"),
        (["--access", "input", "--features-public"], "--features-public applies"),
        (["--access", "prediction", "--label-mechanism", "rr-prior"], "--label-mechanism"),
    ],
)
def test_an_option_of_another_mode_is_refused(tmp_path, args, named):
    out = tmp_path / "run"
    code, _, stderr = dpfy_cli("train", *args, "--out", str(out))
    assert code == 2 and named in one_error_line(stderr)
    assert not out.exists()


def test_out_of_a_running_run_says_running_not_finished(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "status.json").write_text(json.dumps({"status": "running", "pid": 1}))
    (out / "facts.json").write_text("{}")
    code, _, stderr = dpfy_cli("train", "--out", str(out))
    line = one_error_line(stderr)
    assert code == 2 and "still running" in line and "finished" not in line


@pytest.mark.parametrize("rows", [0, 1, 4])
def test_an_adult_csv_too_small_to_split_is_one_clear_line(tmp_path, rows):
    (tmp_path / "adult.csv").write_text(
        ",".join(
            ["age", "workclass", "fnlwgt", "education", "education-num", "marital-status",
             "occupation", "relationship", "race", "sex", "capital-gain", "capital-loss",
             "hours-per-week", "native-country", "income"]
        ) + "\n" + "\n".join(synthetic_rows(rows)) + "\n"
    )  # fmt: skip
    with pytest.raises(ValueError, match=rf"{rows} data rows .* too few .* supply at least"):
        load_dataset("adult", data_dir=tmp_path / "adult.csv")


def _api(**options):
    net = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(64, 4), torch.arange(64) % 2)
    settings = dict(batch_size=8, epochs=1, target_epsilon=3.0, delta=1e-5, max_grad_norm=1.0)
    settings.update(options)
    return dpfy.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), data, **settings)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"seed": -1}, "seed must be a whole number"),
        ({"seed": 1.5}, "seed must be a whole number"),
        ({"seed": "abc"}, "seed must be a whole number"),
        ({"batch_size": "8"}, "batch_size"),
        ({"target_epsilon": "3"}, "target_epsilon must be a number"),
        ({"delta": "1e-5"}, "delta must be a number"),
        ({"max_grad_norm": True}, "max_grad_norm must be a number"),
        ({"epochs": "1"}, "epochs must be a number"),
        ({"accountant": "gdp", "sampler": "fixed-size"}, "accountant must be one of"),
    ],
)
def test_the_api_refuses_what_it_used_to_coerce(options, named):
    with pytest.raises(ValueError, match=named):
        _api(**options)


def test_a_model_with_no_trainable_parameters_is_refused_by_name():
    net = nn.Linear(4, 2).requires_grad_(False)
    data = TensorDataset(torch.randn(64, 4), torch.arange(64) % 2)
    with pytest.raises(ValueError, match="no trainable parameters"):
        dpfy.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), data, batch_size=8,
                          epochs=1, target_epsilon=3.0, delta=1e-5, max_grad_norm=1.0)  # fmt: skip


def test_a_lora_rank_above_the_layer_width_is_refused():
    pytest.importorskip("peft")
    from dpfy.train.lora import add_lora
    from test_finetune import tiny_classifier

    with pytest.raises(ValueError, match="LoRA rank 100000 exceeds the width"):
        add_lora(tiny_classifier().encoder, rank=100_000)
