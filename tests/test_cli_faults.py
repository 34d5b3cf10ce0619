"""Every command: an I/O error is one line and exit code 2; SIGTERM stops it like Ctrl-C."""

from __future__ import annotations

import signal

import pytest
import typer

from dpfy.cli import app as cli


def test_an_os_error_in_any_command_is_one_line_naming_the_file(capsys):
    with pytest.raises(typer.Exit) as stopped, cli._user_errors():
        raise OSError(28, "No space left on device", "/runs/x/report.md")
    assert stopped.value.exit_code == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/runs/x/report.md" in err and "No space left" in err


def test_sigterm_stops_every_command_like_ctrl_c(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: None)
    monkeypatch.setattr(cli, "app", lambda **kw: seen.setdefault("handler", signal.getsignal(
        signal.SIGTERM)))  # fmt: skip
    previous = signal.getsignal(signal.SIGTERM)
    try:
        cli.main()
    finally:
        signal.signal(signal.SIGTERM, previous)
    with pytest.raises(KeyboardInterrupt):
        seen["handler"](signal.SIGTERM, None)
