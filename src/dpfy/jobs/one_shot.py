"""A job that runs in one go, with no checkpoint: claim a fresh run directory, run, release.

The access-model jobs randomise their data once or train an ensemble once, so there is nothing
to resume; each still claims its directory as ``dpfy train`` does, so no finished run is ever
overwritten and two jobs never write into the same directory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dpfy._safe_io import write_failed
from dpfy.jobs.checkpoint import FINISHED, RUNNING, mark_failed, write_status
from dpfy.jobs.config import TrainConfig, write_config
from dpfy.jobs.run_dir import claim_run_dir, release_run_dir

__all__ = ["run_one_shot"]

Result = TypeVar("Result")


def run_one_shot(
    config: TrainConfig, resume: Path | None, no_resume: str, body: Callable[[Path], Result]
) -> Result:
    """Refuse ``resume`` with ``no_resume``, else run ``body`` in a freshly claimed directory."""
    if resume is not None:
        raise ValueError(no_resume)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    default = Path("runs") / (
        f"{config.dataset}-{config.model}-{config.access}-eps{config.target_epsilon:g}-{stamp}"
    )
    run_dir = claim_run_dir(config.out, default)
    try:
        write_config(config, run_dir)
        write_status(run_dir, RUNNING, 0, 1)
        try:
            result = body(run_dir)
        except Exception as err:
            # Never left "running": the run is marked failed, what it wrote is kept, and an OS
            # error at write time is one line naming the file.
            mark_failed(run_dir, err, 0, 1)
            if isinstance(err, OSError):
                raise write_failed(Path(err.filename or run_dir), err) from None
            raise
        write_status(run_dir, FINISHED, 1, 1)
        return result
    finally:
        release_run_dir(run_dir)
