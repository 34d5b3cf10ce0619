"""Gaussian noise sources for the private optimizer: fast (torch RNG) or secure (OS CSPRNG).

``TorchNoise`` draws from torch generators, one on each device the noise is for, seeded from the OS
(or from a seed, for reproducible experiments). ``SecureNoise`` draws every bit from ``os.urandom``
— the operating system's cryptographically secure generator — and turns it into normals by the
Box–Muller transform in float64; an attacker who learns the training code cannot replay or predict
it. Its cost is dominated by ``os.urandom`` (about 8 random bytes per coordinate, two uniforms per
pair of normals; timings in docs/performance.md). Neither defends against floating-point attacks
on the least significant bits of the noise (Mironov 2012); the secure option removes
predictability of the random stream, not that channel.

Noise is never replayed: a checkpoint holds no noise generator state, and a run that resumes calls
:meth:`~NoiseSource.reseed`, which starts a stream never drawn before — from OS entropy, or for a
seeded experiment from the seed, the step it resumes at and how many streams this process has
started afresh, so an experiment script reproduces yet a resumed stream is never the saved one.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from typing import Any, Protocol

import numpy as np
import torch


class NoiseSource(Protocol):
    """Draws i.i.d. N(0, std²) noise shaped like a tensor.

    A source may also offer ``fill_(out, std)``, drawing into ``out`` in place (no temporary);
    :func:`fill_with_noise` uses it when it is there. A source a run resumes with must offer
    ``reseed(step)`` (see :meth:`TorchNoise.reseed`): a resume is refused without it.
    """

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """Noise with the shape, dtype and device of ``like``."""
        ...


#: Streams this process has started afresh (:meth:`TorchNoise.reseed`): part of a seeded resume's
#: seed, so two continuations in one process never share a stream.
_FRESH_STREAMS = itertools.count(1)


def fill_with_noise(source: NoiseSource, out: torch.Tensor, std: float) -> torch.Tensor:
    """Overwrite ``out`` with the source's noise, in place when the source can draw in place."""
    fill = getattr(source, "fill_", None)
    return fill(out, std) if fill is not None else out.copy_(source.normal(out, std))


_CPU = torch.device("cpu")


class TorchNoise:
    """Noise from torch generators, drawn on the device of the tensor it is for.

    One generator per device: CPU tensors get noise from a CPU generator, CUDA tensors from that
    GPU's own generator (its Philox stream), so a model on a GPU never waits for the CPU's
    Mersenne Twister or a host-to-device copy. Seeded from the OS, or all from ``seed``: the CPU
    generator from ``seed`` itself, each other device's from ``seed`` and the device's name
    (:func:`device_seed`), so every stream is reproducible and no two devices share one. A resume
    moves every stream to a fresh one (:meth:`reseed`).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._stream = seed  # the seed of the streams drawn now: ``seed`` until a reseed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._on(_CPU)  # seeded now, so an unseeded source is fixed from the start

    @property
    def generator(self) -> torch.Generator:
        """The CPU generator."""
        return self._generators[_CPU]

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """Noise with ``like``'s shape, dtype and device (std applied inside the draw)."""
        noise = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return self.fill_(noise, std)

    def fill_(self, out: torch.Tensor, std: float) -> torch.Tensor:
        """Overwrite ``out`` with noise in place, from its own device's generator."""
        return out.normal_(0.0, std, generator=self._on(out.device))

    def reseed(self, step: int) -> None:
        """Start streams never drawn before, on every device: what a resumed run draws from.

        Unseeded: fresh OS entropy. Seeded: a seed derived from ``seed``, the ``step`` the run
        resumes at and a count of the streams this process has started afresh
        (:func:`resumed_seed`) — an experiment that resumes reproduces when run again, but its
        continuation never draws the stream the interrupted run drew on from its checkpoint.
        """
        if self.seed is not None:
            self._stream = resumed_seed(self.seed, step, next(_FRESH_STREAMS))
        self._generators.clear()
        self._on(_CPU)

    def state_dict(self) -> dict[str, Any]:
        """Every generator's state (for tests and tools: no checkpoint holds it, since a resumed
        run draws fresh noise, :meth:`reseed`)."""
        generators = dict(self._generators)  # a copy: a draw may add a device meanwhile
        return {
            "generator": generators[_CPU].get_state(),
            "devices": {str(d): g.get_state() for d, g in generators.items() if d != _CPU},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the streams saved by :meth:`state_dict` (a device not saved starts afresh)."""
        self.generator.set_state(state["generator"])
        for name, saved in state.get("devices", {}).items():
            self._on(torch.device(name)).set_state(saved)

    def _on(self, device: torch.device) -> torch.Generator:
        """This source's generator on ``device``, made and seeded at its first draw."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._stream is None:
                generator.seed()
            elif device.type == "cpu":
                generator.manual_seed(self._stream)
            else:
                generator.manual_seed(device_seed(self._stream, str(device)))
            self._generators[device] = generator
        return generator


def device_seed(seed: int, device: str) -> int:
    """A 63-bit seed for ``device``'s generator, derived from the run's seed and the device name.

    Through numpy's SeedSequence (hashing), so devices get unrelated streams from one seed.
    """
    entropy = [seed & (2**64 - 1), zlib.crc32(device.encode())]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))


def resumed_seed(seed: int, step: int, stream: int) -> int:
    """A 63-bit seed for a seeded run's noise after a resume at ``step`` (its ``stream``-th fresh
    stream in this process), unrelated to ``seed``'s own stream by SeedSequence hashing."""
    entropy = [seed & (2**64 - 1), zlib.crc32(b"resumed noise")]
    sequence = np.random.SeedSequence(entropy, spawn_key=(int(step), int(stream)))
    return int(sequence.generate_state(1, np.uint64)[0] >> np.uint64(1))


class SecureNoise:
    """Noise from the OS CSPRNG through Box–Muller; nothing to save, nothing to replay."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """Secure N(0, std²) noise shaped like ``like``."""
        count = like.numel()
        pairs = (count + 1) // 2
        bits = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64).reshape(2, pairs)
        # 53-bit uniforms in (0, 1]: never exactly 0, so the logarithm is finite.
        u1 = ((bits[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
        u2 = (bits[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * math.pi * u2
        values = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
        noise = torch.from_numpy(values).reshape(like.shape)
        return noise.mul_(std).to(device=like.device, dtype=like.dtype)

    def fill_(self, out: torch.Tensor, std: float) -> torch.Tensor:
        """Overwrite ``out`` with secure noise."""
        return out.copy_(self.normal(out, std))

    def reseed(self, step: int) -> None:
        """Nothing to do: every draw is fresh from the OS, after a resume as before it."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A secure source keeps no replayable state."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore: every draw is fresh from the OS."""
