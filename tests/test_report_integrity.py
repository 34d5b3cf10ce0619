"""A re-rendered report recomputes ε from the stored events and never trusts a stored number.

`dpfy report RUN_DIR` rebuilds the ledger from ``facts.json`` and recomputes every ε with the
stored accountant; an edited, impossible or malformed file is refused with one line naming the
file, the field and the fix (exit code 2), and an unedited one renders the recomputation.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.plan.accounting import PldAccountant, dpsgd_event
from dpfy.report.facts import RunFacts
from dpfy.report.render import render_run

Edit = Callable[[dict[str, Any]], None]


def dpfy(*args: str):
    """The command in process: exit code, stdout and stderr as a shell sees them."""
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run directory from the smallest `dpfy train` (logistic regression, 0.2 epochs)."""
    run_dir = tmp_path_factory.mktemp("runs") / "digits"
    run = dpfy("train", "--model", "logreg", "--epochs", "0.2", "--out", str(run_dir))
    assert run.exit_code == 0, run.output
    return run_dir


@pytest.fixture
def run_copy(saved_run: Path, tmp_path: Path) -> Path:
    """A copy of the run to edit."""
    return Path(shutil.copytree(saved_run, tmp_path / "run"))


def edit_facts(run_dir: Path, edit: Edit) -> None:
    path = run_dir / "facts.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))  # NaN and ∞ as JSON's literal extensions


def set_at(*keys: Any, value: Any) -> Edit:
    """An edit that puts ``value`` at ``data[k1][k2]…``."""

    def edit(data: dict[str, Any]) -> None:
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def scale_at(*keys: Any, factor: float) -> Edit:
    """An edit that multiplies the number at ``data[k1][k2]…``."""

    def edit(data: dict[str, Any]) -> None:
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] *= factor

    return edit


def assert_refused(run, *named: str) -> None:
    """Exit code 2 and exactly one line on stderr: 'error: FILE: …' naming the field and fix."""
    assert run.exit_code == 2, run.output
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    (line,) = lines
    assert line.startswith("error: ") and "facts.json" in line, line
    assert "restore the facts.json the run wrote, or train the run again" in line, line
    for name in named:
        assert name in line, line
    assert "Traceback" not in run.output and run.stdout == ""


# -- an unedited run ------------------------------------------------------------------------------


def test_unedited_run_rerenders_identically_and_agrees_with_the_accountant(saved_run):
    markdown = dpfy("report", str(saved_run))
    assert markdown.exit_code == 0, markdown.output
    written = (saved_run / "report.md").read_text(encoding="utf-8")
    assert markdown.stdout == written + "\n"  # echo ends the report with one more newline
    as_json = dpfy("report", str(saved_run), "--format", "json")
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert report == json.loads((saved_run / "report.json").read_text(encoding="utf-8"))
    privacy = json.loads((saved_run / "facts.json").read_text())["privacy"]
    steps = report["accounting"]["steps"]
    expected = (
        PldAccountant()
        .compose(dpsgd_event(privacy["sampling_rate"], privacy["noise_multiplier"], steps))
        .epsilon(privacy["delta"])
    )
    assert report["epsilon"]["total"] == pytest.approx(expected, rel=1e-9)
    assert report["epsilon"]["training"] == report["epsilon"]["total"]
    assert f"({report['epsilon']['total']:.4g}, {privacy['delta']:g})-DP" in markdown.stdout


def test_rerendered_report_prints_the_recomputed_epsilon_not_the_stored_one(run_copy):
    # A drift far below the tolerance is accepted, and still never printed: the report shows
    # the recomputation, digit for digit the one the run wrote.
    before = render_run(run_copy, "json")
    edit_facts(run_copy, scale_at("accounting", "summary", "epsilon", "total", factor=1 + 1e-9))
    stored = json.loads((run_copy / "facts.json").read_text())["accounting"]["summary"]
    loaded = RunFacts.load(run_copy / "facts.json")
    assert loaded.accounting.summary.total_epsilon != stored["epsilon"]["total"]
    assert render_run(run_copy, "json") == before


# -- stored numbers that disagree with the recomputation ------------------------------------------

DISAGREEING = {
    "total epsilon": (
        set_at("accounting", "summary", "epsilon", "total", value=0.01),
        "accounting.summary.epsilon.total is 0.01",
    ),
    "training epsilon": (
        scale_at("accounting", "summary", "epsilon", "training", factor=0.5),
        "accounting.summary.epsilon.training",
    ),
    "invented tuning epsilon": (
        set_at("accounting", "summary", "epsilon", "tuning", value=0.001),
        "accounting.summary.epsilon.tuning",
    ),
    "headline delta": (
        set_at("accounting", "summary", "delta", value=0.01),
        "accounting.summary.delta",
    ),
    "table epsilon": (
        scale_at("accounting", "epsilon_table", 0, "pld", factor=0.9),
        "accounting.epsilon_table[0].pld",
    ),
    "rdp table epsilon": (
        scale_at("accounting", "epsilon_table", 2, "rdp", factor=1.1),
        "accounting.epsilon_table[2].rdp",
    ),
    "poisson epsilon": (
        set_at("accounting", "epsilon_under_poisson_assumption", value=0.5),
        "accounting.epsilon_under_poisson_assumption",
    ),
    "steps in the summary": (
        set_at("accounting", "summary", "steps", value=1),
        "accounting.summary.steps",
    ),
    "sigma in the settings": (
        scale_at("privacy", "noise_multiplier", factor=3.0),
        "privacy.noise_multiplier",
    ),
    "q in the settings": (
        scale_at("privacy", "sampling_rate", factor=0.1),
        "privacy.sampling_rate",
    ),
    "delta in the settings": (set_at("privacy", "delta", value=1e-9), "privacy.delta"),
    "accountant in the settings": (set_at("privacy", "accountant", value="rdp"), "accountant"),
    "sampler in the settings": (set_at("privacy", "sampler", value="fixed-size"), "sampler"),
    "steps taken": (set_at("training", "steps_taken", value=1000), "training.steps_taken"),
    "epochs": (scale_at("training", "epochs", factor=10.0), "training.epochs"),
}


@pytest.mark.parametrize("case", list(DISAGREEING))
def test_stored_figures_that_disagree_with_the_ledger_are_refused(run_copy, case):
    edit, named = DISAGREEING[case]
    edit_facts(run_copy, edit)
    run = dpfy("report", str(run_copy))
    assert_refused(
        run, named, "recomputes ε from the stored events and never trusts a stored number"
    )


# -- impossible values ----------------------------------------------------------------------------

INVALID = {
    "delta above 1": (set_at("privacy", "delta", value=5), "privacy.delta"),
    "delta of 0": (set_at("privacy", "delta", value=0.0), "privacy.delta"),
    "negative sigma": (set_at("privacy", "noise_multiplier", value=-1.0), "noise_multiplier"),
    "NaN sigma": (set_at("privacy", "noise_multiplier", value=math.nan), "noise_multiplier"),
    "'nan' sigma": (set_at("privacy", "noise_multiplier", value="nan"), "noise_multiplier"),
    "infinite sigma": (set_at("privacy", "noise_multiplier", value=math.inf), "noise_multiplier"),
    "zero clip norm": (set_at("privacy", "max_grad_norm", value=0.0), "privacy.max_grad_norm"),
    "negative clip norm": (set_at("privacy", "max_grad_norm", value=-2), "privacy.max_grad_norm"),
    "q above 1": (set_at("privacy", "sampling_rate", value=1.5), "privacy.sampling_rate"),
    "q of 0": (set_at("privacy", "sampling_rate", value=0.0), "privacy.sampling_rate"),
    "negative steps": (set_at("training", "steps_taken", value=-3), "training.steps_taken"),
    "negative planned steps": (set_at("privacy", "steps", value=-1), "privacy.steps"),
    "unknown accountant": (set_at("privacy", "accountant", value="magic"), "privacy.accountant"),
    "unknown ledger accountant": (
        set_at("accounting", "ledger_state", "accountant", value="magic"),
        "accounting.ledger_state",
    ),
    "ledger delta above 1": (
        set_at("accounting", "ledger_state", "delta", value=5),
        "accounting.ledger_state",
    ),
    "negative ledger sigma": (
        set_at("accounting", "ledger_state", "entries", 0, "noise_multiplier", value=-1.0),
        "accounting.ledger_state",
    ),
    "NaN ledger sigma": (
        set_at("accounting", "ledger_state", "entries", 0, "noise_multiplier", value=math.nan),
        "noise_multiplier",
    ),
    "negative ledger count": (
        set_at("accounting", "ledger_state", "entries", 0, "count", value=-4),
        "accounting.ledger_state",
    ),
    "NaN accuracy": (set_at("results", "accuracy", value=math.nan), "results.accuracy"),
    "NaN table delta": (
        set_at("accounting", "epsilon_table", 0, "delta", value=math.nan),
        "accounting.epsilon_table[0].delta",
    ),
    "unknown sampler": (set_at("privacy", "sampler", value="lottery"), "privacy.sampler"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_impossible_stored_values_are_refused(run_copy, case):
    edit, named = INVALID[case]
    edit_facts(run_copy, edit)
    assert_refused(dpfy("report", str(run_copy)), named)


# -- malformed files ------------------------------------------------------------------------------


def _rewrite(run_dir: Path, transform: Callable[[bytes], bytes]) -> None:
    path = run_dir / "facts.json"
    path.write_bytes(transform(path.read_bytes()))


def _without(*keys: str) -> Edit:
    def edit(data: dict[str, Any]) -> None:
        target = data
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return edit


MALFORMED: dict[str, tuple[Callable[[Path], None], str]] = {
    "not JSON": (lambda d: _rewrite(d, lambda b: b"this is not json"), "is not valid JSON"),
    "truncated": (lambda d: _rewrite(d, lambda b: b[: len(b) // 2]), "is not valid JSON"),
    "empty": (lambda d: _rewrite(d, lambda b: b""), "is not valid JSON"),
    "not UTF-8": (lambda d: _rewrite(d, lambda b: b"\xff\xfe" + b[2:]), "is not UTF-8"),
    "latin-1 text": (
        lambda d: _rewrite(d, lambda b: b.replace(b'"name": "digits"', b'"name": "d\xefgits"')),
        "is not UTF-8",
    ),
    "a list": (lambda d: _rewrite(d, lambda b: b"[1, 2, 3]"), "must be a JSON object"),
    "a number": (lambda d: _rewrite(d, lambda b: b"3"), "must be a JSON object"),
    "no accounting": (lambda d: edit_facts(d, _without("accounting")), "accounting"),
    "no privacy delta": (lambda d: edit_facts(d, _without("privacy", "delta")), "delta"),
    "no summary epsilon": (
        lambda d: edit_facts(d, _without("accounting", "summary", "epsilon")),
        "accounting.summary.epsilon",
    ),
    "no ledger entries": (
        lambda d: edit_facts(d, _without("accounting", "ledger_state", "entries")),
        "entries",
    ),
    "string count": (
        lambda d: edit_facts(d, set_at("dataset", "size", value="many")),
        "dataset.size",
    ),
    "string sigma": (
        lambda d: edit_facts(d, set_at("privacy", "noise_multiplier", value="high")),
        "privacy.noise_multiplier",
    ),
    "bool steps": (
        lambda d: edit_facts(d, set_at("training", "steps_taken", value=True)),
        "training.steps_taken",
    ),
    "list as model": (lambda d: edit_facts(d, set_at("model", value=[1])), "model"),
    "string as grad norms": (
        lambda d: edit_facts(d, set_at("grad_norms", value="fine")),
        "grad_norms",
    ),
    "number as median norm": (
        lambda d: edit_facts(d, set_at("grad_norms", "median", value="3.7")),
        "grad_norms.median",
    ),
    "dict as table": (
        lambda d: edit_facts(d, set_at("accounting", "epsilon_table", value={})),
        "accounting.epsilon_table",
    ),
    "number as notes": (
        lambda d: edit_facts(d, set_at("accounting", "notes", value=7)),
        "accounting.notes",
    ),
    "foreign version": (lambda d: edit_facts(d, set_at("version", value=99)), "version"),
    "facts from before the typed summary": (
        lambda d: edit_facts(d, set_at("version", value=1)),
        "not version-2 dpfy run facts",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_facts_file_is_one_clear_error(run_copy, case):
    corrupt, named = MALFORMED[case]
    corrupt(run_copy)
    assert_refused(dpfy("report", str(run_copy)), named)


def test_load_refusal_is_a_value_error_naming_the_file(run_copy):
    edit_facts(run_copy, set_at("accounting", "summary", "epsilon", "total", value=0.01))
    with pytest.raises(ValueError, match=r"facts\.json: accounting\.summary\.epsilon\.total"):
        RunFacts.load(run_copy / "facts.json")


# -- reading and writing the card's files: bounded reads, whole files ----------------------------


def test_loading_facts_from_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    fifo = tmp_path / "facts.json"
    os.mkfifo(fifo)

    def hung(signum, frame):
        raise AssertionError("RunFacts.load waited on a FIFO instead of refusing it")

    previous = signal.signal(signal.SIGALRM, hung)  # a blocking open would hang: fail instead
    signal.alarm(30)
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            RunFacts.load(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_failed_write_leaves_the_published_card_whole(run_copy, monkeypatch):
    from dpfy._safe_io import WriteFailed
    from dpfy.report.render import write_report

    before = {name: (run_copy / name).read_bytes() for name in ("report.md", "facts.json")}
    facts = RunFacts.load(run_copy / "facts.json")

    def disk_full(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(WriteFailed, match="No space left on device"):
        write_report(facts, run_copy, plots=False)
    monkeypatch.undo()
    after = {name: (run_copy / name).read_bytes() for name in before}
    assert after == before
    assert not [p for p in run_copy.iterdir() if p.name.endswith(".tmp")]
