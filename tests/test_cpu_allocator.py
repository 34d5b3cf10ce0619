"""The CPU allocator setting: a step's freed temporaries are reused, not page-faulted back in."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting only applies to glibc's malloc",
)

# A step's temporaries, in miniature: 64 buffers of 1 MiB alive together, then freed. Default
# glibc gives the memory at the top of its heap back to the OS once more than twice the largest
# block it has unmapped is free there, and faults every page in again next round.
SCRIPT = """
import resource, torch
from torch import nn
from dpfy.train.grads import make_engine
make_engine(nn.Linear(2, 2))
def round_():
    buffers = [torch.ones(1 << 18) for _ in range(64)]
    del buffers
for _ in range(6):  # glibc's aligned allocations settle into reusable free blocks
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    round_()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3)
"""
PAGES_PER_ROUND = 64 * (1 << 20) // 4096


def _faults_per_round(switch: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if switch is not None:
        env["DPFY_KEEP_FREED_MEMORY"] = switch
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def test_make_engine_on_cpu_keeps_freed_memory_for_the_next_step() -> None:
    assert _faults_per_round(None) < 0.05 * PAGES_PER_ROUND


def test_switch_off_leaves_malloc_alone() -> None:
    # The same rounds fault again without the setting, so the check above can fail. Whether
    # default glibc trims depends on where its heap top lies, which varies from run to run.
    assert any(_faults_per_round("0") > 0.5 * PAGES_PER_ROUND for _ in range(4))


def test_keep_freed_memory_reports_whether_it_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpfy.train.cpu_allocator import ENV_SWITCH, keep_freed_memory

    keep_freed_memory.cache_clear()
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert keep_freed_memory() is False
    keep_freed_memory.cache_clear()
    monkeypatch.delenv(ENV_SWITCH)
    assert keep_freed_memory() is True
