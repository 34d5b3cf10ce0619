"""The CLI contract: `dpfy account` and `dpfy plan`, their JSON, and one-line errors."""

from __future__ import annotations

import json
import subprocess

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.plan.accounting import PldAccountant, RdpAccountant, dpsgd_event


def dpfy(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in process (the installed entry point is run by tests/test_packaging.py)."""
    result = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


ACCOUNT = ["account", "--sampling-rate", "0.005", "--noise-multiplier", "1", "--steps", "200"]


@pytest.mark.parametrize(("name", "cls"), [("pld", PldAccountant), ("rdp", RdpAccountant)])
def test_account_json_reports_the_accountants_epsilon(name, cls):
    run = dpfy(*ACCOUNT, "--delta", "1e-6", "--accountant", name, "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    expected = cls().compose(dpsgd_event(0.005, 1.0, 200)).epsilon(1e-6)
    assert result["epsilon"] == pytest.approx(expected)
    assert result["delta"] == 1e-6
    assert result["accountant"] == name


def test_account_table_is_human_readable():
    run = dpfy(*ACCOUNT, "--delta", "1e-6")
    assert run.returncode == 0, run.stderr
    assert "epsilon" in run.stdout and "0.58" in run.stdout


def test_plan_json_calibrates_sigma():
    run = dpfy(
        "plan", "--dataset-size", "60000", "--batch-size", "256", "--epochs", "10",
        "--target-epsilon", "3", "--delta", "1e-5", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert set(result) >= {
        "epsilon",
        "delta",
        "accountant",
        "noise_multiplier",
        "sampling_rate",
        "steps",
    }
    assert result["steps"] == 2344
    assert result["sampling_rate"] == pytest.approx(256 / 60000)
    accounted = (
        PldAccountant()
        .compose(dpsgd_event(result["sampling_rate"], result["noise_multiplier"], result["steps"]))
        .epsilon(1e-5)
    )
    assert accounted == pytest.approx(result["epsilon"]) and accounted <= 3.0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--delta", "1.5"], "delta"),
        (["--delta", "0"], "delta"),
        (["--delta", "nan"], "delta"),
        (["--delta", "1e-5", "--sampling-rate", "2"], "sampling_rate"),
        (["--delta", "1e-5", "--noise-multiplier", "-1"], "noise_multiplier"),
        (["--delta", "1e-5", "--steps", "-3"], "steps"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    base = dict(zip(ACCOUNT[1::2], ACCOUNT[2::2], strict=True))
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    run = dpfy("account", *[part for pair in base.items() for part in pair])
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0]


def test_plan_refuses_a_batch_larger_than_the_dataset():
    run = dpfy(
        "plan", "--dataset-size", "100", "--batch-size", "500", "--epochs", "1",
        "--target-epsilon", "1", "--delta", "1e-5",
    )  # fmt: skip
    assert run.returncode == 2 and "batch_size" in run.stderr and "Traceback" not in run.stderr


def test_rdp_reports_its_order_and_warns_on_the_grid_edge():
    run = dpfy(
        "account", "--sampling-rate", "1e-5", "--noise-multiplier", "50", "--steps", "2",
        "--delta", "1e-6", "--accountant", "rdp", "--json",
    )  # fmt: skip
    assert run.returncode == 0
    assert json.loads(run.stdout)["rdp_order"] == 1024
    assert run.stderr.startswith("warning:") and "largest of the grid" in run.stderr
