"""File input and output that cannot hang, exhaust memory or leave a half-written file behind.

Reads: a path given by the user (``--config``, a run directory's ``facts.json`` or
``status.json``) may name a FIFO, a device such as ``/dev/zero``, or a file far larger than any
dpfy file. Each is opened without blocking, checked to be a regular file, and read up to a bound,
so a bad path is one line, never a hang or a process the kernel kills; JSON nested too deeply to
parse is one line too, never a RecursionError.

Writes: a file is written beside its target, flushed and fsynced, then renamed over it, and the
directory fsynced, so a crash or a full disk leaves either the old file or the new one, whole —
never a 0-byte ``config.json``. An OS error at write time is :class:`WriteFailed`, a ValueError
naming the file and the error, which the command line prints as one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_JSON_BYTES",
    "WriteFailed",
    "atomic_write",
    "atomic_write_text",
    "check_regular_file",
    "fsync_directory",
    "read_bounded",
    "read_json",
    "write_failed",
]

#: Largest JSON file dpfy reads (a config, a status, a run's facts with its ledger): far above any
#: file dpfy writes, far below what would exhaust memory.
MAX_JSON_BYTES = 64 * 2**20


class WriteFailed(ValueError):
    """Writing a file failed (disk full, read-only, …); what was there before is unchanged."""


def _kind(mode: int) -> str:
    """A plain word for what a non-regular path is."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular_file(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a regular file (following links), without opening it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(
            f"{what} {path} is {_kind(mode)}, not a regular file; pass the path of a file"
        )


def read_bounded(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file ``path``, refused in one line if it is anything else or
    larger than ``limit``; opened non-blocking, so a FIFO never waits for a writer."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as err:
        raise ValueError(f"{what} {path} cannot be read ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(
                f"{what} {path} is {_kind(info.st_mode)}, not a regular file; pass the path of "
                "a file"
            )
        os.set_blocking(fd, True)
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(
            f"{what} {path} is larger than {limit // 2**20} MiB, far beyond any file dpfy "
            "writes; pass the file dpfy wrote"
        )
    return data


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in ``path`` (bounded, regular file only); one ValueError if unreadable,
    not UTF-8, not JSON, or nested too deeply to parse."""
    raw = read_bounded(path, what, limit)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {path} is not valid JSON ({err})") from None
    except RecursionError:
        raise ValueError(f"{what} {path} is nested too deeply to be a dpfy file") from None


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_failed(path: Path, err: BaseException) -> WriteFailed:
    """The one error for a write the OS (or torch's writer) refused."""
    reason = (
        getattr(err, "strerror", None) or " ".join(str(err).split())[:200] or type(err).__name__
    )
    return WriteFailed(
        f"cannot write {path} ({reason}); free space or choose a writable --out — files already "
        "written were left as they were"
    )


def atomic_write(path: Path, write: Callable[[Path], None], *, mode: int = 0o644) -> Path:
    """Call ``write(temporary)``, fsync the temporary, rename it over ``path`` and fsync the
    directory: ``path`` is the old file or the new one, whole. Any OSError (or torch's I/O
    RuntimeError) is :class:`WriteFailed`, with the temporary removed."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.close(fd)
        write(temporary)
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except (OSError, RuntimeError) as err:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise write_failed(path, err) from None
    fsync_directory(path.parent)
    return path


def atomic_write_text(path: Path, text: str, *, mode: int = 0o644) -> Path:
    """Write ``text`` (UTF-8) into ``path`` atomically and durably (:func:`atomic_write`)."""
    return atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"),
                        mode=mode)  # fmt: skip
