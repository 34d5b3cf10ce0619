"""The seam through which a training session writes its report card.

The report stage sits above training (it reads the session), so training cannot import it.
``PrivateTraining.report`` asks this seam for the writer, which loads the report stage by name
on first use; that one late-bound edge is declared in the import-graph test, so no other
upward import can hide behind it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The module that provides ``write_session_report(training, out_dir, **details)``.
REPORT_MODULE = "dpfy.report.session_report"


def report_writer() -> Callable[..., dict[str, Path]]:
    """The report stage's writer for a live session."""
    return importlib.import_module(REPORT_MODULE).write_session_report  # type: ignore[no-any-return]


def write(training: Any, out_dir: str | Path, **details: Any) -> dict[str, Path]:
    """Write ``training``'s report card into ``out_dir``; returns the written paths by name."""
    return report_writer()(training, out_dir, **details)
