"""Which job runs each access model (guide §3.2) for ``dpfy train --access NAME``.

Torch-free, so the CLI lists the choices cheaply: each name maps to ``"module:function"``, the
job imported only when it runs. Every job takes ``(config, console, *, resume)`` and returns a
:class:`~dpfy.jobs.train.TrainResult`. A new access model is one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["ACCESS_JOBS", "ACCESS_NAMES", "access_job"]

ACCESS_JOBS: dict[str, str] = {
    "full": "dpfy.jobs.train:run_training",
    "label": "dpfy.jobs.access_runs:run_label_training",
    "input": "dpfy.jobs.access_runs:run_input_training",
    "prediction": "dpfy.jobs.prediction_job:run_prediction_training",
}

#: The access models ``dpfy train --access`` offers, full training first (the default).
ACCESS_NAMES: tuple[str, ...] = tuple(ACCESS_JOBS)


def access_job(name: str) -> Callable[..., Any]:
    """The job that trains under access model ``name``; one clear error for an unknown one."""
    if name not in ACCESS_JOBS:
        raise ValueError(f"access must be one of {', '.join(ACCESS_NAMES)}; got {name!r}")
    module, function = ACCESS_JOBS[name].split(":")
    return getattr(importlib.import_module(module), function)
