"""A checkpoint's seal: its format, its parts, and a content digest that binds them together.

A resumed run continues the ledger it loads, so a checkpoint must not be able to hand it a ledger
that is not the one the run kept: one from an earlier checkpoint (fewer steps), another run's, an
emptied one, or a file whose bytes changed on disk. The digest (SHA-256 over every key, type,
shape and byte) catches any change to the file's content; the binding check in
:mod:`dpfy.train.session` catches parts that were put together from different places. The digest is
integrity, not authentication: whoever can run dpfy can also seal an edited checkpoint.

A checkpoint holds no noise generator state: every process that resumes draws fresh noise, so no
continuation can replay the noise the interrupted run drew (version 4). Version-3 checkpoints,
which held it, still load: their digest is checked over everything they hold, then the noise
state is dropped unread.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dpfy._safe_io import fsync_directory, write_failed

FORMAT = "dpfy.checkpoint"
VERSION = 4
PARTS = ("plan", "model", "optimizer", "ledger", "loader", "mechanism", "run")
#: Parts only older versions hold, dropped once their digest is checked.
_DROPPED = {3: ("noise",)}


def save_atomically(state: Any, target: Path) -> Path:
    """``torch.save`` into ``target`` so a crash mid-write keeps the previous file whole.

    The file is owner-only: mkstemp creates it so, and os.replace keeps that (a checkpoint holds
    the sampling generator's state, from which the batches drawn can be reconstructed). It is
    fsynced before the rename (and the directory after), so after a power loss the target is the
    old checkpoint or the new one, never a renamed empty file. A full disk or any other OS error
    — torch reports its own as a RuntimeError — is one :class:`~dpfy._safe_io.WriteFailed`
    naming the file, with the previous checkpoint untouched.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    except OSError as err:
        raise write_failed(target, err) from None
    os.close(handle)
    try:
        torch.save(state, temporary)
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except (OSError, RuntimeError) as err:
        raise write_failed(target, err) from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    fsync_directory(target.parent)
    return target


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint dict with its format marker, version and content digest."""
    body = {"format": FORMAT, "version": VERSION, **state}
    return {**body, "digest": state_digest(body)}


def unseal(state: Any) -> dict[str, Any]:
    """The checkpoint's parts, after refusing anything but an intact checkpoint of this format
    (an older version's parts that are no longer read left out)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("not a dpfy checkpoint (missing format marker); nothing was loaded")
    version = state.get("version")
    if version != VERSION and version not in _DROPPED:
        raise ValueError(
            f"unsupported dpfy checkpoint version {version!r} (this dpfy reads versions "
            f"{', '.join(map(str, sorted({*_DROPPED, VERSION})))}); nothing was loaded"
        )
    dropped = _DROPPED.get(version, ())
    missing = [part for part in (*PARTS, *dropped, "digest") if part not in state]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {', '.join(missing)}; it is incomplete or was edited. "
            "Nothing was loaded — resume from an intact checkpoint"
        )
    body = {key: value for key, value in state.items() if key != "digest"}
    if state["digest"] != state_digest(body):
        raise ValueError(
            "the checkpoint's content does not match its digest: it was corrupted or edited "
            "after it was written (an in-memory state_dict() shares tensors with the live run, "
            "so training on changes it: save it with PrivateTraining.save or deep-copy it). "
            "Nothing was loaded — resume from an intact checkpoint"
        )
    return {key: value for key, value in body.items() if key not in dropped}


def state_digest(value: Any) -> str:
    """SHA-256 of a nested structure of dicts, sequences, tensors and plain values."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    """Hash ``value`` with a type tag, so that different structures never collide."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu")
        tensor = tensor.to_dense() if tensor.is_sparse else tensor.contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda item: repr(item[0]))
        digest.update(f"D{len(items)}".encode())
        for key, item in items:
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{'L' if isinstance(value, list) else 'U'}{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, float):
        digest.update(f"F{value.hex() if math.isfinite(value) else repr(value)}".encode())
    elif value is None or isinstance(value, (bool, int, str, bytes)):
        digest.update(f"{type(value).__name__}:{value!r}".encode())
    else:
        digest.update(f"O{type(value).__qualname__}:{value!r}".encode())
