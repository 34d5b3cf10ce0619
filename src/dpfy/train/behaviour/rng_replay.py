"""Run code again under the random state a forward pass started from, leaving the user's stream.

A probe that re-runs the model must draw the same dropout masks as the pass it is compared with,
or randomness would look like coupling; and it must not consume the user's random stream, or a
seeded run would train differently with the probes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class RandomState:
    """The CPU and CUDA random states at one moment (CUDA: the devices the model lives on)."""

    def __init__(self, model: nn.Module) -> None:
        self.devices = sorted(
            {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}
        )
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside: the random state is this one; after: the caller's, as it was."""
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            yield
