"""A training job's checkpoint and status: what ``dpfy train --resume RUN_DIR`` continues from.

The run directory holds two files for this. ``checkpoint.pt`` is the private session's own sealed
checkpoint (model, optimizer, ledger and sampler state, :meth:`PrivateTraining.state_dict`) plus
what the job itself carries over (its history, the gradient norms its report summarises and the
seconds trained so far). It holds the sampling random state, from which the batches drawn could
be reconstructed, so it is written owner-only and deleted once the run finishes. ``status.json``
says whether the run is running (and in which process), interrupted or finished.

A checkpoint is resumed once. Every resume draws fresh noise, so two continuations of one
checkpoint are two releases of the steps after it, and each would report only its own spend. So
the first resume records the checkpoint as consumed — a file in ``.dpfy-resumed/`` named by the
digest its seal computed, created exclusively before training continues — and a second resume
of the same content is refused, however the file got back. The continuation's own checkpoints
have other contents and resume in turn.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpfy._safe_io import atomic_write_text, check_regular_file, read_json
from dpfy.report.clip_norms import NormLog
from dpfy.train.checkpoints import save_atomically
from dpfy.train.session import PrivateTraining

CHECKPOINT_FILE = "checkpoint.pt"
STATUS_FILE = "status.json"
RESUMED_DIR = ".dpfy-resumed"  # one file per checkpoint resumed, named by its content digest
_LOCK_FILE = ".dpfy-resume-lock"
_FORMAT = "dpfy.train-job-checkpoint"

RUNNING, INTERRUPTED, FINISHED = "running", "interrupted", "finished"
#: A run stopped by an error (a failing step, a full disk): what it wrote so far is kept.
FAILED = "failed"


@dataclass
class JobState:
    """What the job carries over a resume besides the private session itself."""

    history: list[dict[str, float]] = field(default_factory=list)
    norms: NormLog = field(default_factory=NormLog)
    seconds: float = 0.0


def save_checkpoint(private: PrivateTraining, run_dir: Path, job: JobState) -> Path:
    """Write ``checkpoint.pt`` atomically (owner-only): a crash mid-write keeps the previous one.

    Collective under torchrun (every rank calls it at the same step); rank 0 alone writes.
    """
    target = run_dir / CHECKPOINT_FILE
    state = {
        "format": _FORMAT,
        "session": private.state_dict(),
        "history": job.history,
        "norms": torch.from_numpy(job.norms.norms.astype(np.float32)),
        "seconds": float(job.seconds),
    }
    if private.replicas.is_writer:
        save_atomically(state, target)
    private.replicas.barrier()
    return target


def load_checkpoint(private: PrivateTraining, run_dir: Path) -> JobState:
    """Restore the session from ``checkpoint.pt`` (all or nothing), record the checkpoint as
    resumed, and return the job's state.

    The record is made once the session has loaded and before any step, exclusively: of two
    continuations of one checkpoint only one trains. Collective under torchrun (rank 0 records).
    """
    path = run_dir / CHECKPOINT_FILE
    state = _read(path, run_dir)
    digest = _digest(state, path)
    private.load_state_dict(state["session"])
    private.replicas.on_writer(lambda: _record_resume(run_dir, digest, private.ledger.steps))
    norms = NormLog()
    if len(state["norms"]):
        norms.add(state["norms"])
    return JobState(list(state["history"]), norms, float(state["seconds"]))


def _read(path: Path, run_dir: Path, *, mmap: bool = False) -> dict[str, Any]:
    """The job checkpoint at ``path``, or the one message for why it cannot be resumed."""
    try:
        check_regular_file(path, "checkpoint")  # a FIFO or a device would block or never end
    except FileNotFoundError:
        raise ValueError(no_checkpoint(run_dir)) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise ValueError(no_checkpoint(run_dir)) from None
    except Exception as err:
        raise ValueError(
            f"{path} is corrupt or not a dpfy checkpoint ({type(err).__name__}); it cannot be "
            "resumed: start a new run"
        ) from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a `dpfy train` checkpoint; it cannot be resumed")
    return state


def _digest(state: dict[str, Any], path: Path) -> str:
    """The content digest the session's seal computed: what a resume record is keyed by."""
    session = state.get("session")
    digest = session.get("digest") if isinstance(session, dict) else None
    if not isinstance(digest, str) or not digest.isalnum():
        raise ValueError(f"{path} has no intact seal (no content digest); it cannot be resumed")
    return digest


def _resumed(run_dir: Path, digest: str) -> Path:
    """Where the record that the checkpoint with ``digest`` was resumed lives."""
    return run_dir / RESUMED_DIR / f"{digest}.json"


def _already_resumed(run_dir: Path, record: Path) -> str:
    """The one message refusing a second continuation of a checkpoint."""
    try:
        earlier = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        earlier = {}
    earlier = earlier if isinstance(earlier, dict) else {}
    when = (
        f" (at step {earlier.get('step')}, {earlier.get('time')}, by process "
        f"{earlier.get('pid')} on {earlier.get('host')})"
        if "step" in earlier
        else ""
    )
    return (
        f"{run_dir / CHECKPOINT_FILE} was already resumed once{when}; nothing was changed. A "
        "resume draws fresh noise, so continuing the same checkpoint again would be a second "
        "release of the same steps, and each continuation's ledger and report would count only "
        "its own spend. Start a new run, or resume the latest checkpoint that continuation "
        f"wrote (it replaces {CHECKPOINT_FILE} at each evaluation; this one is not among them: "
        "the continuation stopped before its first checkpoint, or this file was put back)"
    )


def _record_resume(run_dir: Path, digest: str, step: int) -> None:
    """Record, exclusively, that the checkpoint with ``digest`` is being resumed."""
    record = _resumed(run_dir, digest)
    try:
        record.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(_already_resumed(run_dir, record)) from None
    except OSError as err:
        raise ValueError(
            f"cannot record the resume in {record.parent} ({err.strerror or err}); resume needs it"
        ) from None
    document = {
        "checkpoint_digest": digest,
        "step": step,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(document, indent=2) + "\n")


def checkpoint_consumed(run_dir: Path) -> bool:
    """Whether ``run_dir``'s checkpoint was already resumed once (False without a readable one)."""
    path = run_dir / CHECKPOINT_FILE
    try:
        return _resumed(run_dir, _digest(_read(path, run_dir, mmap=True), path)).exists()
    except ValueError:
        return False


def remove_checkpoint(run_dir: Path) -> None:
    """Delete the checkpoint of a finished run: its random state must not outlive the run."""
    with contextlib.suppress(FileNotFoundError):
        (run_dir / CHECKPOINT_FILE).unlink()


def no_checkpoint(run_dir: Path) -> str:
    """The one message for a directory without a checkpoint to resume."""
    return (
        f"{run_dir} holds no checkpoint to resume ({CHECKPOINT_FILE} is missing): the run "
        "finished, or stopped before its first checkpoint; pass the directory of an "
        "interrupted `dpfy train` run, or start a new run"
    )


def write_status(
    run_dir: Path,
    status: str,
    steps_taken: int,
    planned_steps: int,
    *,
    resumable: bool = True,
    error: str | None = None,
) -> None:
    """Record the run's state, and which process holds it while it runs (and, interrupted, the
    command that resumes it, unless its checkpoint was already resumed once; failed, the error).

    Written beside ``status.json``, fsynced and renamed over it: a crash or a full disk leaves
    the previous status whole (:func:`dpfy._safe_io.atomic_write_text`).
    """
    document: dict[str, Any] = {
        "status": status,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "steps_taken": steps_taken,
        "planned_steps": planned_steps,
    }
    if status == INTERRUPTED and resumable:
        document["resume"] = f"dpfy train --resume {run_dir}"
    if error is not None:
        document["error"] = error
    atomic_write_text(run_dir / STATUS_FILE, json.dumps(document, indent=2) + "\n")


def restore_status(run_dir: Path, document: dict[str, Any] | None) -> None:
    """Put back a status document read earlier (a resume that failed before its first step
    leaves the run as it found it: interrupted, not running in a process that has ended)."""
    if document is None:
        return
    with contextlib.suppress(ValueError):
        atomic_write_text(run_dir / STATUS_FILE, json.dumps(document, indent=2) + "\n")


def mark_failed(run_dir: Path, err: BaseException, steps_taken: int, planned_steps: int) -> None:
    """Best effort: record that the run stopped on ``err`` (a full disk may refuse even this;
    what was written before is never touched)."""
    reason = " ".join(str(err).split()) or type(err).__name__
    with contextlib.suppress(ValueError, OSError):
        write_status(run_dir, FAILED, steps_taken, planned_steps, error=reason[:500])


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``status.json``, or None where there is none (or it is unreadable, not a
    regular file, or absurdly large: it is read bounded and without blocking)."""
    try:
        document = read_json(run_dir / STATUS_FILE, "status file", limit=2**20)
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def running_elsewhere(status: dict[str, Any]) -> bool:
    """Whether the process a running status names may still run: on another host it is assumed
    so (``--force`` overrides that), on this one it is asked."""
    if status.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(status["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError, OverflowError):
        return True
    return True


def _stale_hint(run_dir: Path) -> str:
    """How to take over a run whose process is gone but looks alive (another host, reused PID)."""
    return (
        f"if that process is gone (it ran on another host, or its PID was reused), "
        f"`dpfy train --resume {run_dir} --force` takes the run over"
    )


def force_takeover(run_dir: Path | None) -> None:
    """``--resume RUN_DIR --force``: declare the process status.json names gone, so the run is
    resumable again (status interrupted, the stale resume lock removed). Only a run marked
    running is changed; its checkpoint, ledger and resume records are untouched, so a
    checkpoint resumed before is still refused."""
    if run_dir is None:
        raise ValueError(
            "--force goes with --resume RUN_DIR (it takes over a run whose process is gone); "
            "drop --force, or add --resume"
        )
    status = read_status(run_dir)
    if status is None or status.get("status") != RUNNING:
        return
    with contextlib.suppress(FileNotFoundError):
        (run_dir / _LOCK_FILE).unlink()
    write_status(run_dir, INTERRUPTED, int(status.get("steps_taken", 0) or 0),
                 int(status.get("planned_steps", 0) or 0))  # fmt: skip


def claim_for_resume(run_dir: Path) -> dict[str, Any] | None:
    """Take over ``run_dir`` to resume it: refused while another process trains or resumes it.

    The check and the new running status (naming this process) happen under an exclusive lock
    file, so of two resumes of one directory started together exactly one proceeds; the other
    then finds the run running in a live process and is refused. A checkpoint that was resumed
    before (:func:`load_checkpoint` records it) is refused here, with nothing changed, and so
    is a run an audit is writing to. Returns the status it replaced, which a resume that fails
    before its first step puts back (:func:`restore_status`).
    """
    from dpfy.jobs.run_lock import audit_in_progress

    if not (run_dir / CHECKPOINT_FILE).is_file():
        if (run_dir / CHECKPOINT_FILE).exists():
            check_regular_file(run_dir / CHECKPOINT_FILE, "checkpoint")  # a FIFO, a device
        if not run_dir.is_dir():
            raise ValueError(f"--resume {run_dir} is not a directory; pass a run directory")
        raise ValueError(no_checkpoint(run_dir))
    lock = run_dir / _LOCK_FILE
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(
            f"{run_dir} is being taken over by another resume ({_LOCK_FILE} exists); wait, "
            f"or, {_stale_hint(run_dir)}"
        ) from None
    except OSError as err:
        raise ValueError(
            f"cannot write to {run_dir} ({err.strerror or err}); resume needs it"
        ) from None
    os.close(fd)
    try:
        status = read_status(run_dir) or {}
        if status.get("status") == FINISHED:
            raise ValueError(f"{run_dir} holds a finished run; there is nothing to resume")
        if status.get("status") == RUNNING and running_elsewhere(status):
            raise ValueError(
                f"{run_dir} is being trained by process {status.get('pid')} on "
                f"{status.get('host')}; stop it first (Ctrl-C or SIGTERM leaves a checkpoint), "
                f"then resume; {_stale_hint(run_dir)}"
            )
        auditor = audit_in_progress(run_dir)
        if auditor is not None:
            raise ValueError(
                f"{run_dir} is being audited by {auditor}; resume once the audit has finished "
                "(it writes the run's report)"
            )
        path = run_dir / CHECKPOINT_FILE
        record = _resumed(run_dir, _digest(_read(path, run_dir, mmap=True), path))
        if record.exists():
            raise ValueError(_already_resumed(run_dir, record))
        write_status(run_dir, RUNNING, int(status.get("steps_taken", 0) or 0),
                     int(status.get("planned_steps", 0) or 0))  # fmt: skip
        return status or None
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
