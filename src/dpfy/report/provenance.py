"""Which dpfy source a run used: the git commit of the package's own checkout, if it is one.

A version number names a release, but a run from a development checkout may have used any commit
after it, with or without local edits; the report names the commit so the run can be reproduced
(guide §5.3.3: code and libraries). The answer is a plain string and never an error: a package
installed from a wheel, a missing ``git`` or a broken repository each give a sentence saying so.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

NOT_A_CHECKOUT = "not a git checkout"
_TIMEOUT_S = 5.0
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/dpfy, not src/dpfy/report


def _git(directory: Path, *args: str) -> str | None:
    """``git -C directory args`` stdout, or None when git is missing, fails or hangs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # no foreign repo
    try:
        done = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            env=env,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(package_dir: str | os.PathLike[str] | None = None) -> str:
    """The commit the package source came from, flagged when it has uncommitted changes.

    Only a checkout that tracks the package's own files counts: a wheel installed into a
    virtual environment that happens to sit inside some other repository is not a checkout of
    dpfy, so the tracked-file check keeps that repository's commit out of the report.
    """
    directory = Path(package_dir) if package_dir is not None else _PACKAGE_DIR
    if not directory.is_dir():
        return NOT_A_CHECKOUT
    if not _git(directory, "ls-files", "--", "__init__.py"):
        return NOT_A_CHECKOUT  # not in a work tree, or the package's files are not tracked
    commit = _git(directory, "rev-parse", "HEAD")
    if not commit:
        return NOT_A_CHECKOUT
    changes = _git(directory, "status", "--porcelain", "--", ".")
    if changes is None:
        return f"{commit} (could not tell whether the source has uncommitted changes)"
    return f"{commit} (with uncommitted changes to the package source)" if changes else commit


__all__ = ["NOT_A_CHECKOUT", "source_commit"]
