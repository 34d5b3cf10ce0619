"""One BLAS thread while an optimiser runs: its many tiny vector operations are several times
slower when OpenBLAS spreads each over every core (measured: 5× for L-BFGS-B on 8 variables).

threadpoolctl comes with scikit-learn, a dependency of dpfy; without it nothing changes.
"""

from __future__ import annotations

import contextlib
from typing import Any


def single_threaded() -> contextlib.AbstractContextManager[Any]:
    """A context in which BLAS uses one thread (a no-op when threadpoolctl is missing)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - scikit-learn brings it
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")
