"""A run's directory, claimed before anything is written: new or empty, never shared.

A run writes its report, facts, model and plots into one directory. It claims it first with a
marker file created with O_EXCL, so a run never overwrites files it did not write and two runs
(two processes, or two threads) never share one. ``train``, ``federated`` and ``tune`` use it.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

#: Files whose presence marks a directory as holding a finished run (never overwritten).
FINISHED_MARKERS = ("report.json", "facts.json")

#: The file that claims a directory for one run. It is created with O_EXCL before anything else
#: is written, so of two runs on one directory exactly one gets it, and the other writes nothing.
RUN_MARKER = ".dpfy-run"

_CLAIMS: dict[Path, str] = {}  # run directories this process claimed -> the token in the marker
_MADE: set[Path] = set()  # run directories this process created (removed again if left unused)


def _key(path: Path) -> Path:
    """The registry key of a run directory: its absolute path, however it was spelt."""
    return Path(os.path.abspath(path))


def _unwritable(path: Path, err: OSError) -> ValueError:
    """The one error for a run directory the OS will not let us create or write."""
    return ValueError(
        f"cannot write to --out {path} ({err.strerror or err}); choose a writable directory"
    )


def fresh_run_dir(base: Path) -> Path:
    """Create ``base`` as a new, empty directory, or ``base-2``, ``base-3``, … if it is taken.

    mkdir without exist_ok is atomic, so two default runs started in the same second get two
    directories, never one between them.
    """
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(base.parent, err) from None
    for attempt in range(1, 10_000):
        candidate = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError as err:
            raise _unwritable(candidate, err) from None
        _MADE.add(_key(candidate))
        return candidate
    raise ValueError(f"{base} and 9,998 numbered variants exist already; pass --out DIR")


def _refuse_occupied(path: Path) -> None:
    """Refuse a path that is not a new or empty directory, naming what is in the way."""
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_dir():
        raise ValueError(
            f"--out {path} exists and is not a directory; pass a new directory for the run"
        )
    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        raise _unwritable(path, err) from None
    running = _status(path).get("status") == "running"
    if running:
        raise ValueError(
            f"--out {path} holds a run still running (its status.json says so; if its process "
            f"died, `dpfy train --resume {path} --force` takes it over); choose another --out "
            "directory for a new run"
        )
    if _interrupted(path):
        raise ValueError(
            f"{path} holds an interrupted run; `dpfy train --resume {path}` continues it, or "
            "choose another --out directory for a new run"
        )
    finished = next((name for name in FINISHED_MARKERS if name in names), None)
    if finished is not None:
        raise ValueError(
            f"{path} already holds a finished run ({finished} exists); choose another --out "
            "directory — an existing run is never overwritten"
        )
    if RUN_MARKER in names:
        raise ValueError(
            f"{path} is already claimed by another dpfy run ({RUN_MARKER} exists) and two runs "
            "never share a directory; choose another --out directory (or delete this one if "
            "that run died)"
        )
    if names:
        shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
        raise ValueError(
            f"--out {path} is not empty (it holds {shown}); dpfy writes only into a new or empty "
            "directory, so it never overwrites files it did not write: choose another --out"
        )


def _status(path: Path) -> dict:
    """``path``'s status.json (bounded, regular file only), or {} where there is none."""
    from dpfy._safe_io import read_json

    try:
        status = read_json(path / "status.json", "status file", limit=2**20)
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _interrupted(path: Path) -> bool:
    """Whether ``path`` holds a run stopped part-way that ``--resume`` can continue."""
    return _status(path).get("status") == "interrupted"


def prepare_run_dir(path: Path) -> Path:
    """Claim ``path`` for one run before anything is written; refuse it, changing nothing, if
    it holds anything already (the user's files, another run), or cannot be written."""
    if not str(path).strip():
        raise ValueError("--out is empty; pass a directory for the run, or omit --out")
    path = Path(path)
    _refuse_occupied(path)
    key = _key(path)
    try:
        try:
            path.mkdir(parents=True)
            _MADE.add(key)
        except FileExistsError:
            pass  # made meanwhile, by the user or a racing run: the marker below decides
        fd = os.open(path / RUN_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        _refuse_occupied(path)  # a racing run claimed it first: say so
        raise
    except OSError as err:
        raise _unwritable(path, err) from None
    token = secrets.token_hex(16)
    with os.fdopen(fd, "w") as marker:
        json.dump({"claimed_by": "dpfy", "pid": os.getpid(), "token": token}, marker)
    _CLAIMS[key] = token
    return path


def claim_run_dir(out: Path | None, default: Path) -> Path:
    """The run's directory, claimed: ``out`` if given (new or empty), else a fresh ``default``."""
    if out is not None:
        return prepare_run_dir(out)
    path = fresh_run_dir(default)
    try:
        return prepare_run_dir(path)
    except ValueError:
        release_run_dir(path)
        raise


def release_run_dir(path: Path) -> None:
    """Drop this process's claim on ``path`` once the run ends or fails.

    A run that wrote nothing besides its marker (it failed before its first file) leaves nothing
    behind: the marker goes, and the directory too if the run made it, so the same --out works
    again. Anything else, or a claim another process holds, is left exactly as it is.
    """
    key = _key(path)
    token = _CLAIMS.pop(key, None)
    made = key in _MADE
    _MADE.discard(key)
    try:
        names = os.listdir(path)
        ours = token is not None and names == [RUN_MARKER]
        if ours and json.loads((path / RUN_MARKER).read_text()).get("token") == token:
            (path / RUN_MARKER).unlink()
            names = []
        if made and not names:
            path.rmdir()
    except (OSError, ValueError, AttributeError):
        pass  # best effort: a leftover empty directory or marker is refused, never overwritten
