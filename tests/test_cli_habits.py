"""`dpfy train` fits a script's habits: a short summary, --quiet, --json, paths never cut, exit 3
on an ERROR pitfall, choices listed and checked, help that agrees with the defaults, a replayable
config.json, and built-in pipelines that flag nothing of their own making."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import numpy as np
import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.data.idx import write_idx
from dpfy.jobs.config import (
    DATASET_NAMES,
    ENGINE_NAMES,
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    TrainConfig,
    read_config,
)

QUICK = ["train", "--model", "logreg", "--epochs", "0.3"]


def dpfy(*args: str, columns: int | None = None) -> tuple[int, str, str]:
    """Run the CLI in-process (output not a terminal): exit code, stdout, stderr."""
    env = None if columns is None else {"COLUMNS": str(columns)}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ------------------------------------------------------------------ output


def test_the_summary_keeps_long_paths_whole_on_narrow_piped_output(tmp_path):
    out = tmp_path / ("a-run-directory-with-a-rather-long-name-" * 3) / "run"
    code, stdout, stderr = dpfy(*QUICK, "--out", str(out), columns=40)
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert f"run directory: {out}" in lines
    assert f"report: {out / 'report.md'}" in lines
    assert any(line.startswith("test accuracy (DP): ") for line in lines)
    assert any(line.startswith("ε spent: ") and "δ = 1e-05" in line for line in lines)
    assert "# Privacy report" not in stdout  # the whole card stays in report.md


def test_quiet_prints_only_the_run_directory(tmp_path):
    code, stdout, stderr = dpfy(*QUICK, "--out", str(tmp_path / "run"), "--quiet")
    assert code == 0, stderr
    assert stdout == f"{tmp_path / 'run'}\n"


def test_json_prints_one_object_with_the_figures_pitfalls_and_paths(tmp_path):
    code, stdout, stderr = dpfy(*QUICK, "--out", str(tmp_path / "run"), "--json")
    assert code == 0, stderr
    result = json.loads(stdout)  # the whole of stdout is one JSON object
    assert result["run_dir"] == str(tmp_path / "run") and result["status"] == "finished"
    assert 0 <= result["test_accuracy"] <= 1 and 0 < result["epsilon"] <= 3.0
    assert result["delta"] == 1e-5 and result["algorithm"] == "DP-SGD"
    assert result["pitfalls"] == [] or all("severity" in p for p in result["pitfalls"])
    for name, path in result["paths"].items():
        assert Path(path) == tmp_path / "run" / name and Path(path).is_file()


def test_quiet_and_json_together_are_refused():
    code, _, stderr = dpfy(*QUICK, "--quiet", "--json")
    assert code == 2 and "--quiet or --json" in one_error_line(stderr)


@pytest.mark.parametrize(
    ("args", "code_shown"),
    [(["--delta", "0.01"], "delta-too-large"), (["--seed", "1", "--strict"], "seeded-randomness")],
    ids=["delta", "seed-strict"],
)
def test_an_error_pitfall_exits_3_after_everything_is_written(tmp_path, args, code_shown):
    out = tmp_path / "run"
    code, stdout, stderr = dpfy(*QUICK, *args, "--out", str(out))
    assert code == 3
    assert f" {code_shown}: " in stdout
    assert ("ERROR pitfall" in stderr or "--strict was given" in stderr) and "exit code 3" in stderr
    for name in ("report.md", "report.json", "facts.json", "model.pt", "config.json"):
        assert (out / name).is_file(), name
    flagged = [p["code"] for p in json.loads((out / "report.json").read_text())["pitfalls"]]
    assert code_shown in flagged


def test_a_seeded_run_is_a_warning_that_exits_0_unless_strict(tmp_path):
    code, stdout, stderr = dpfy(*QUICK, "--seed", "1", "--out", str(tmp_path / "run"))
    assert code == 0, stderr
    assert "WARN seeded-randomness: " in stdout and "ERROR" not in stdout
    code, stdout, _ = dpfy(*QUICK, "--seed", "1", "--json", "--out", str(tmp_path / "again"))
    document = json.loads(stdout)
    assert code == 0 and document["exit_code"] == 0
    assert {"severity": "warning", "code": "seeded-randomness"}.items() <= next(
        p for p in document["pitfalls"] if p["code"] == "seeded-randomness"
    ).items()


def test_help_documents_the_exit_codes():
    code, stdout, _ = dpfy("train", "--help", columns=200)
    assert code == 0
    assert "Exit codes: 0 done; 2 bad input; 3 the run finished" in stdout
    assert "130 interrupted" in stdout


# ------------------------------------------------------------------ choices and help


@pytest.mark.parametrize(
    ("command", "option", "bad"),
    [
        ("train", "--dataset", "digitz"),
        ("train", "--model", "resnet"),
        ("train", "--engine", "turbo"),
        ("train", "--algorithm", "dp-adam"),
        ("train", "--optimizer", "lion"),
        ("train", "--unit", "group"),
        ("federated", "--dataset", "digitz"),
        ("federated", "--model", "resnet"),
        ("federated", "--server-optimizer", "adamw"),
    ],
)
def test_a_typo_in_a_choice_is_one_line_naming_the_choices(tmp_path, command, option, bad):
    code, _, stderr = dpfy(command, option, bad, "--out", str(tmp_path / "run"))
    assert code == 2
    line = one_error_line(stderr)
    assert option in line and bad in line and "is not one of" in line
    assert not (tmp_path / "run").exists()


def test_help_lists_each_choice():
    _, stdout, _ = dpfy("train", "--help", columns=300)
    for names in (DATASET_NAMES, MODEL_NAMES, ENGINE_NAMES, OPTIMIZER_NAMES):
        assert "|".join(names) in stdout


def test_the_torch_free_name_lists_match_their_registries():
    from typing import get_args

    from dpfy.data.datasets import available_datasets
    from dpfy.federated.aggregate import SERVER_OPTIMIZERS
    from dpfy.federated.config import SERVER_OPTIMIZER_NAMES
    from dpfy.jobs.train import OPTIMIZERS
    from dpfy.train.grads.make import EngineChoice
    from dpfy.train.models import available_models

    assert set(DATASET_NAMES) == set(available_datasets())
    assert set(MODEL_NAMES) == set(available_models())
    assert set(ENGINE_NAMES) == set(get_args(EngineChoice))
    assert set(OPTIMIZER_NAMES) == set(OPTIMIZERS)
    assert set(SERVER_OPTIMIZER_NAMES) == set(SERVER_OPTIMIZERS)


def _options(command: str) -> list[click.Option]:
    group = typer.main.get_command(app)
    return [p for p in group.commands[command].params if isinstance(p, click.Option)]


def _shown(value: object) -> str:
    return str(value.value if hasattr(value, "value") else value)


@pytest.mark.parametrize("command", ["train", "federated", "tune", "account", "plan"])
def test_help_that_states_a_default_states_the_actual_one(command):
    """An option whose help mentions its default must name the value the parser uses."""
    for option in _options(command):
        text = option.help or ""
        said = re.search(r"default[:\s]+([^;)]*)", text, flags=re.IGNORECASE)
        if said is None or option.default is None:
            continue  # no claim, or the help says what leaving it unset means
        assert _shown(option.default) in said.group(1), (option.name, text, option.default)


# ------------------------------------------------------------------ DP-FTRL says what runs


def test_a_dp_ftrl_run_is_labelled_dp_ftrl_with_epochs_not_a_sampling_rate(tmp_path):
    from dpfy.jobs.train import run_training

    console = Console(record=True, width=300)
    config = TrainConfig(model="logreg", epochs=2, algorithm="dp-ftrl", out=tmp_path / "run")
    result = run_training(config, console)
    text = console.export_text()
    banner = text.splitlines()[0]
    assert "DP-FTRL, tree aggregation" in banner and "2 epochs" in banner
    assert "no sampling assumption" in banner and "q =" not in banner
    assert "DP-SGD" not in text and "DP-FTRL" in text.splitlines()[1]  # the progress bar
    assert result.algorithm == "DP-FTRL"


# ------------------------------------------------------------------ config.json replay


def test_config_replay_reproduces_the_settings_and_with_a_seed_the_accuracy(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    args = [*QUICK, "--lr", "0.05", "--batch-size", "64", "--seed", "4", "--json"]
    code, stdout, _ = dpfy(*args, "--out", str(first))
    assert code == 0  # seeded: a WARN, an experiment
    code, replayed, _ = dpfy("train", "--config", str(first / "config.json"), "--json",
                             "--out", str(second))  # fmt: skip
    assert code == 0
    one, two = read_config(first / "config.json"), read_config(second / "config.json")
    assert one == TrainConfig(model="logreg", epochs=0.3, lr=0.05, batch_size=64, seed=4,
                              out=first)  # fmt: skip
    assert two == TrainConfig(**{**one.__dict__, "out": second})
    assert json.loads(replayed)["test_accuracy"] == json.loads(stdout)["test_accuracy"]


def test_options_given_with_config_override_the_replayed_ones(tmp_path):
    first = tmp_path / "first"
    assert dpfy(*QUICK, "--lr", "0.05", "--out", str(first))[0] == 0
    code, _, stderr = dpfy("train", "--config", str(first / "config.json"), "--epochs", "0.2",
                           "--out", str(tmp_path / "second"))  # fmt: skip
    assert code == 0, stderr
    replayed = read_config(tmp_path / "second" / "config.json")
    assert (replayed.epochs, replayed.lr, replayed.model) == (0.2, 0.05, "logreg")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"command": "federated", "rounds": 3}', "holds no `dpfy train` settings"),
        ('{"command": "train", "epochz": 3}', "does not know (epochz)"),
        ('{"command": "train", "epochs": "three"}', "epochs is 'three', not float"),
        ("not json", "is not valid JSON"),
    ],
)
def test_a_config_that_is_not_a_train_config_is_one_line(tmp_path, content, needle):
    (tmp_path / "config.json").write_text(content)
    code, _, stderr = dpfy("train", "--config", str(tmp_path / "config.json"))
    assert code == 2 and needle in one_error_line(stderr)


# ------------------------------------------------------------------ no ERROR of dpfy's making


def _idx_dir(directory: Path) -> Path:
    rng = np.random.default_rng(0)
    directory.mkdir()
    for prefix, n in (("train", 60), ("t10k", 10)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz",
                  rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))  # fmt: skip
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n, dtype=np.uint8) % 10)
    return directory


def _adult_dir(directory: Path) -> Path:
    directory.mkdir()
    rows = [
        "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, "
        "White, Male, 2174, 0, 40, United-States, <=50K",
        "50, Self-emp-not-inc, 83311, Bachelors, 13, Married-civ-spouse, Exec-managerial, "
        "Husband, White, Male, 0, 0, 13, United-States, >50K",
    ]
    (directory / "adult.data").write_text("\n".join(rows * 40) + "\n")
    return directory


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> dict[str, Path | None]:
    root = tmp_path_factory.mktemp("data")
    return {
        "digits": None,
        "breast-cancer": None,
        "mnist": _idx_dir(root / "mnist"),
        "fashion-mnist": _idx_dir(root / "fashion"),
        "adult": _adult_dir(root / "adult"),
    }


@pytest.mark.parametrize("dataset", DATASET_NAMES)
@pytest.mark.parametrize(
    ("unit", "algorithm"),
    [
        ("example", "dp-sgd"),
        ("user", "dp-sgd"),
        ("example", "dp-ftrl"),
        ("example", "bandmf"),
        ("example", "blt"),
    ],
)
def test_built_in_pipelines_flag_no_error_pitfall_of_their_own(
    tmp_path, data_dirs, dataset, unit, algorithm
):
    from dpfy.jobs.train import run_training

    users = {"unit": "user", "users": 10, "batch_size": 5} if unit == "user" else {}
    small = {"batch_size": 16} if data_dirs[dataset] is not None and unit != "user" else {}
    config = TrainConfig(
        dataset=dataset, model="logreg", epochs=0.5, algorithm=algorithm,
        data_dir=data_dirs[dataset], out=tmp_path / "run", **users, **small,
    )  # fmt: skip
    result = run_training(config, Console(quiet=True))
    errors = [p.code for p in result.pitfalls if p.severity.value == "error"]
    assert errors == [], f"{dataset}/{unit}/{algorithm}: {errors}"
