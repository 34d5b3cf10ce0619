"""One CLI: the same option names for the same things on every command (old spellings still
work, hidden), choices checked while parsing, --json / --quiet wherever a command produces a
result, and the small wrongs a reader of the output sees put right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app


def dpfy(*args: str, columns: int | None = None) -> tuple[int, str, str]:
    env = None if columns is None else {"COLUMNS": str(columns)}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


COMMANDS = ("train", "tune", "federated", "finetune", "audit")


@pytest.mark.parametrize("command", ["train", "tune", "federated", "finetune"])
def test_the_clip_norm_is_max_grad_norm_on_every_training_command(command):
    code, stdout, _ = dpfy(command, "--help", columns=200)
    assert code == 0 and "--max-grad-norm" in stdout
    assert "--clip-norm" not in stdout  # the old federated spelling is hidden


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_with_a_result_offers_json_and_quiet(command):
    code, stdout, _ = dpfy(command, "--help", columns=200)
    assert code == 0 and "--json" in stdout and "--quiet" in stdout


def test_the_old_federated_spelling_still_works_and_both_spellings_are_refused(tmp_path):
    code, _, stderr = dpfy("federated", "--clip-norm", "0", "--out", str(tmp_path / "x"))
    assert code == 2 and "clip_norm" in one_error_line(stderr)  # reached the config's check
    code, _, stderr = dpfy(
        "federated", "--clip-norm", "1", "--max-grad-norm", "2", "--out", str(tmp_path / "x")
    )
    assert code == 2 and "old spelling of --max-grad-norm" in one_error_line(stderr)
    assert not (tmp_path / "x").exists()


def test_max_examples_per_user_is_the_field_name_and_the_old_spelling_still_works(tmp_path):
    code, stdout, _ = dpfy("train", "--help", columns=200)
    assert "--max-examples-per-user" in stdout and "--max-user-examples" not in stdout
    for option in ("--max-examples-per-user", "--max-user-examples"):
        code, _, stderr = dpfy("train", option, "0", "--unit", "user",
                               "--out", str(tmp_path / "x"))  # fmt: skip
        assert code == 2 and "max_examples_per_user" in one_error_line(stderr), option
    code, _, stderr = dpfy("train", "--max-user-examples", "2", "--max-examples-per-user", "3")
    assert code == 2 and "old spelling" in one_error_line(stderr)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["audit", "RUN", "--method", "classic"], "'classic' is not one of "),
        (["finetune", "--mode", "last-x"], "--mode"),
        (["finetune", "--mode", "everything"], "last-N"),
    ],
)
def test_choices_are_checked_while_parsing(tmp_path, args, named):
    args = [str(tmp_path / "run") if a == "RUN" else a for a in args]
    code, _, stderr = dpfy(*args)
    assert code == 2 and named in one_error_line(stderr)


def test_report_on_a_tune_directory_points_at_its_final_run(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "facts.json").write_text("{}")
    code, _, stderr = dpfy("report", str(tmp_path))
    line = one_error_line(stderr)
    assert code == 2 and "`dpfy tune` directory" in line
    assert f"dpfy report {tmp_path / 'final'}" in line


def test_label_dp_without_public_features_says_epsilon_covers_the_labels_only(tmp_path):
    code, stdout, stderr = dpfy("train", "--access", "label", "--model", "logreg", "--epochs",
                                "0.3", "--out", str(tmp_path / "run"))  # fmt: skip
    assert code == 0, stderr
    covers = next(line for line in stdout.splitlines() if line.startswith("ε covers: "))
    assert "labels only" in covers and "NOT declared public" in covers
    code, stdout, _ = dpfy("train", "--access", "label", "--features-public", "--model",
                           "logreg", "--epochs", "0.3", "--json", "--out",
                           str(tmp_path / "public"))  # fmt: skip
    covered = json.loads(stdout)["epsilon_covers"]
    assert "labels only" in covered and "declared public" in covered and "NOT" not in covered


def test_a_full_training_run_says_epsilon_covers_the_whole_example(tmp_path):
    code, stdout, _ = dpfy("train", "--model", "logreg", "--epochs", "0.3", "--json",
                           "--out", str(tmp_path / "run"))  # fmt: skip
    assert code == 0
    assert json.loads(stdout)["epsilon_covers"] == "the whole example (features and label)"
    assert Path(json.loads(stdout)["run_dir"]) == tmp_path / "run"


@pytest.mark.parametrize(
    ("classes", "best", "noted"),
    [(2, 0.9, False), (2, 0.55, True), (10, 0.15, True), (10, 0.5, False), (3, 0.42, True)],
)
def test_tunings_near_chance_note_fires_near_chance_only(classes, best, noted):
    """On binary data twice chance is 1.0: the note must not fire on every binary dataset."""
    from types import SimpleNamespace

    from dpfy.tune.pipeline import _check_informative

    outcome = SimpleNamespace(results=[SimpleNamespace(accuracy=best)], notes=[])
    _check_informative(outcome, num_classes=classes)
    assert bool(outcome.notes) is noted


def test_federated_json_prints_the_run_and_its_files(tmp_path):
    args = ["federated", "--users", "10", "--clients-per-round", "5", "--rounds", "2"]
    code, stdout, stderr = dpfy(*args, "--json", "--out", str(tmp_path / "run"))
    assert code == 0, stderr
    document = json.loads(stdout)
    assert document["run_dir"] == str(tmp_path / "run") and document["rounds"] == 2
    assert Path(document["paths"]["report.md"]) == tmp_path / "run" / "report.md"
    assert not any(name.startswith(".") for name in document["paths"])


def test_report_json_is_the_json_format(tmp_path):
    run = tmp_path / "run"
    assert dpfy("train", "--model", "logreg", "--epochs", "0.3", "--out", str(run))[0] == 0
    code, stdout, _ = dpfy("report", str(run), "--json")
    assert code == 0 and stdout == dpfy("report", str(run), "--format", "json")[1]
    assert json.loads(stdout)["format"] == "dpfy.report.render"


def test_finetune_json_prints_the_run(tmp_path):
    pytest.importorskip("transformers")
    from dpfy.data.text_datasets import RT_FILE
    from test_finetune import tiny_classifier, tiny_tokenizer, write_snippets

    model_dir, data_dir = tmp_path / "tiny-bert", tmp_path / "rt"
    tiny_classifier(seed=1).encoder.save_pretrained(model_dir)
    (tmp_path / "vocab").mkdir()
    tiny_tokenizer(tmp_path / "vocab").save_pretrained(model_dir)
    data_dir.mkdir()
    write_snippets(data_dir / RT_FILE, 2200)
    out = tmp_path / "run"
    code, stdout, stderr = dpfy(
        "finetune", "--model-dir", str(model_dir), "--data-dir", str(data_dir), "--epochs", "1",
        "--batch-size", "40", "--limit", "80", "--max-length", "8", "--out", str(out), "--json",
    )  # fmt: skip
    assert code == 0, stderr
    document = json.loads(stdout)  # one JSON object, no progress text on stdout
    assert document["run_dir"] == str(out) and document["report"] == str(out / "report.md")
    assert 0 < document["epsilon"] <= 8.0 and 0 <= document["test_accuracy"] <= 1
