"""``dpfy finetune`` end to end on a tiny BERT saved to a local model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

pytest.importorskip("transformers")

from dpfy.cli.finetune_command import finetune
from dpfy.data.text_datasets import RT_FILE
from dpfy.jobs.finetune import run_finetune
from dpfy.jobs.finetune_config import FinetuneConfig
from test_finetune import tiny_classifier, tiny_tokenizer, write_snippets


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pretrained encoder and its tokenizer, saved as Hugging Face saves them."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    tiny_classifier(seed=1).encoder.save_pretrained(folder)
    tiny_tokenizer(tmp_path_factory.mktemp("vocab")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("rt")
    write_snippets(folder / RT_FILE, 2200)
    return folder


def test_the_job_writes_a_run_directory_whose_report_names_the_public_weights(
    model_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    config = FinetuneConfig(
        model_dir=model_dir, data_dir=data_dir, mode="last-1", epochs=2, batch_size=40,
        lr=1e-2, seed=0, baseline=True, out=tmp_path / "run", limit=120, max_length=10,
    )  # fmt: skip
    result = run_finetune(config)
    run = tmp_path / "run"
    for name in ("report.md", "report.json", "facts.json", "history.json", "config.json"):
        assert (run / name).is_file(), name
    card = json.loads((run / "report.json").read_text())
    assert any(model_dir.name in item and "pretrained weights" in item
               for item in card["released"]["public"])  # fmt: skip
    facts = json.loads((run / "facts.json").read_text())
    assert facts["model"]["frozen"] > 0  # the cached bottom layers are counted, frozen
    assert facts["training"]["loss_normalisation"] == "per-example-mean"
    assert not facts["model"]["unnoised_trainable_names"]
    rows = json.loads((run / "history.json").read_text())["rows"]
    assert [row["epoch"] for row in rows] == [1, 2]
    assert result.epsilon <= 8.0 and result.baseline_accuracy is not None
    # the non-private baseline is an un-noised diagnostic: in diagnostics.json, not on the card
    assert "baseline_accuracy" not in (run / "report.json").read_text()
    diagnostics = json.loads((run / "diagnostics.json").read_text())
    assert diagnostics["baseline_accuracy"] == result.baseline_accuracy


def test_the_command_runs_and_prints_where_the_report_is(
    model_dir: Path, data_dir: Path, tmp_path: Path
) -> None:
    app = typer.Typer()
    app.command()(finetune)
    out = tmp_path / "cli-run"
    args = ["--model-dir", str(model_dir), "--data-dir", str(data_dir), "--mode", "head",
            "--epochs", "1", "--batch-size", "40", "--limit", "80", "--max-length", "8",
            "--out", str(out), "--baseline"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"report: {out}/report.md" in result.output
    assert f"diagnostics (not for publication): {out}/diagnostics.md" in result.output
    assert (out / "diagnostics.md").is_file()
    assert "DP fine-tuning" in result.output and "baseline without privacy" in result.output


def test_a_bad_mode_is_one_error_line_and_exit_code_2(model_dir: Path, tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(finetune)
    result = CliRunner().invoke(app, ["--mode", "middle", "--model-dir", str(model_dir),
                                      "--out", str(tmp_path / "x")])  # fmt: skip
    assert result.exit_code == 2
    assert "unknown fine-tuning mode 'middle'" in result.output
    assert not (tmp_path / "x").exists()


def test_the_finetune_command_lists_its_optimizers_and_refuses_another_by_name():
    from typer.testing import CliRunner

    from dpfy.cli.app import app

    result = CliRunner().invoke(app, ["finetune", "--optimizer", "adamx"])
    assert result.exit_code == 2
    assert "'adamx' is not one of 'adamw', 'adam', 'sgd'" in result.output
