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
import resource, sys, torch
from torch import nn
from dpfy.train.cpu_allocator import keep_freed_memory
from dpfy.train.grads import make_engine
make_engine(nn.Linear(2, 2))  # the library alone leaves malloc as it is
if sys.argv[1] == "opt-in":
    keep_freed_memory()  # what the dpfy command and the benchmarks do
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


def _faults_per_round(switch: str | None, mode: str = "opt-in") -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if switch is not None:
        env["DPFY_KEEP_FREED_MEMORY"] = switch
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def test_opting_in_keeps_freed_memory_for_the_next_step() -> None:
    assert _faults_per_round(None) < 0.05 * PAGES_PER_ROUND


def test_switch_off_leaves_malloc_alone() -> None:
    # The same rounds fault again without the setting, so the check above can fail. Whether
    # default glibc trims depends on where its heap top lies, which varies from run to run.
    assert any(_faults_per_round("0") > 0.5 * PAGES_PER_ROUND for _ in range(4))


def test_making_an_engine_leaves_the_host_process_allocator_alone() -> None:
    # A library must not change its host's malloc: only an explicit call (the CLI's) does.
    assert any(_faults_per_round(None, "library") > 0.5 * PAGES_PER_ROUND for _ in range(4))


def test_the_dpfy_command_opts_in(monkeypatch: pytest.MonkeyPatch) -> None:
    import dpfy.cli.app as cli

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(sys, "argv", ["dpfy", "--version"])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 0 and calls == [1]


def test_keep_freed_memory_reports_whether_it_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    from dpfy.train.cpu_allocator import ENV_SWITCH, keep_freed_memory

    keep_freed_memory.cache_clear()
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert keep_freed_memory() is False
    keep_freed_memory.cache_clear()
    monkeypatch.delenv(ENV_SWITCH)
    assert keep_freed_memory() is True
