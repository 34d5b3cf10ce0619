"""Issue 35, item 5: `dpfy finetune` on a bad model directory or --max-length is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

pytest.importorskip("transformers")

from dpfy.cli.finetune_command import finetune
from dpfy.data.text_datasets import RT_FILE
from test_finetune import tiny_classifier, tiny_tokenizer, write_snippets


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-bert")
    tiny_classifier(seed=1).encoder.save_pretrained(folder)  # 32 positions
    tiny_tokenizer(tmp_path_factory.mktemp("vocab")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("rt")
    write_snippets(folder / RT_FILE, 2200)
    return folder


def run(*args: str) -> tuple[int, str]:
    app = typer.Typer()
    app.command()(finetune)
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


def common(model: Path, data: Path, out: Path) -> list[str]:
    return ["--model-dir", str(model), "--data-dir", str(data), "--mode", "head", "--epochs",
            "1", "--batch-size", "40", "--limit", "80", "--out", str(out)]  # fmt: skip


def test_max_length_beyond_the_models_positions_is_one_line(model_dir, data_dir, tmp_path):
    code, output = run(*common(model_dir, data_dir, tmp_path / "run"), "--max-length", "4096")
    line = one_error_line(output)
    assert code == 2 and "--max-length 4096 exceeds the 32 positions" in line


def test_a_model_config_that_is_not_json_is_one_line(model_dir, data_dir, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").write_text("{not json")
    code, output = run(*common(broken, data_dir, tmp_path / "run"), "--max-length", "8")
    assert code == 2 and "not valid JSON" in one_error_line(output)


def test_truncated_weights_are_one_line(model_dir, data_dir, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    weights = next(p for p in broken.iterdir() if p.suffix in (".safetensors", ".bin"))
    weights.write_bytes(weights.read_bytes()[:100])
    code, output = run(*common(broken, data_dir, tmp_path / "run"), "--max-length", "8")
    line = one_error_line(output)
    assert code == 2 and "cannot load the weights" in line
