"""Keeping freed CPU memory for the next step, so a step's large temporaries do not page-fault.

Every training step allocates and frees the same large temporaries (activations, output
gradients, per-example gradients, a convolution's work buffers). glibc's ``malloc`` serves large
blocks with ``mmap`` and gives free memory at the top of its heap back to the OS once it passes a
trim threshold; the next step asks for the same sizes again, and the kernel zero-fills each page
on first touch, which costs a private step (whose engine keeps more tensors alive at once) tens
of milliseconds of system time (docs/performance.md). PyTorch's CUDA caching allocator keeps
freed GPU memory for reuse in the same way; on the CPU torch leaves it to ``malloc``.

:func:`keep_freed_memory` serves blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit)
from the heap and trims the heap only when more than 1 GiB at its top is free. The process's
resident memory then stays at its peak instead of shrinking between steps. It is process-wide,
and a library must not change its host process's allocator on its own, so nothing in dpfy calls it
implicitly: the ``dpfy`` command and the benchmarks turn it on (and say so), and a training
script may call it itself. ``DPFY_KEEP_FREED_MEMORY=0`` makes the call a no-op. Other C
libraries (musl, macOS, Windows) are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

__all__ = ["ENV_SWITCH", "keep_freed_memory"]

#: Environment variable that turns the setting off when it is "0".
ENV_SWITCH = "DPFY_KEEP_FREED_MEMORY"

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_TRIM_THRESHOLD = 1 << 30
_TOP_PAD = 64 << 20  # grow the heap in large steps: fewer brk calls while a step warms up


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed blocks for reuse; True when the setting is in effect.

    Idempotent (the first call decides). False on other C libraries, or when
    ``DPFY_KEEP_FREED_MEMORY=0``.
    """
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
        (_M_TOP_PAD, _TOP_PAD),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)
