"""The audit lock of a run directory: two audits of one run take turns, and a resume waits for
neither but is refused while an audit holds it.

It is an ``fcntl.flock`` on :data:`AUDIT_LOCK` in the run directory: the kernel drops it when
the holding process ends, however it ends, so it never goes stale and needs no ``--force``. The
file names the holder (process and host) for the messages of those refused.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

__all__ = ["AUDIT_LOCK", "AuditLock", "audit_in_progress"]

#: The lock file two audits of one run take turns on (and a resume checks).
AUDIT_LOCK = ".dpfy-audit.lock"


class AuditLock:
    """An exclusive lock on a run directory for one audit, held until :meth:`release` (or the
    process ends)."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir, self._fd = run_dir, fd

    def release(self) -> None:
        """Let the next audit (or a resume) of the run go ahead."""
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> AuditLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def audit_in_progress(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s audit lock ("process N on HOST"), or None when no audit runs."""
    try:
        fd = os.open(Path(run_dir) / AUDIT_LOCK, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.read(fd, 4096) or b"{}")
        except ValueError:
            holder = {}
        holder = holder if isinstance(holder, dict) else {}
        return f"process {holder.get('pid', '?')} on {holder.get('host', '?')}"
    finally:
        os.close(fd)
    return None
