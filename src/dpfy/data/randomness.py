"""Where sampling decisions get their randomness: a seeded torch generator or the OS CSPRNG.

The DP guarantee of Poisson sampling assumes the inclusion decisions are unpredictable to an
adversary. A torch generator (Mersenne Twister) is reproducible and fast, and the default one is
seeded from the OS so that ``torch.manual_seed(0)`` elsewhere does not make every run draw the same
batches. ``SecureSource`` draws every decision from the operating system's CSPRNG
(``os.urandom`` / ``random.SystemRandom``): nothing is reproducible or resumable bit-for-bit, and
it costs 8 bytes of OS randomness per example per Poisson step and a Python-level Fisher–Yates
shuffle per epoch for the shuffle sampler (timings in docs/performance.md).

Bernoulli decisions are exact up to 2⁻⁵³: an index is kept when a uniform 53-bit integer is below
``floor(q · 2⁵³)``, so the realised inclusion probability is never above q (a slightly lower rate
only strengthens the guarantee), and it differs from q by less than 1.2 × 10⁻¹⁶.
"""

from __future__ import annotations

import abc
import os
import random

import numpy as np
import torch

_BITS = 53
_SCALE = 1 << _BITS


def _threshold(sampling_rate: float) -> int:
    """The integer cut-off that keeps an index with probability floor(q·2⁵³)/2⁵³ ≤ q."""
    return int(sampling_rate * _SCALE)  # exact: q·2⁵³ is a float product by a power of two


class RandomSource(abc.ABC):
    """The three draws samplers need, behind one interface so a CSPRNG can replace torch's."""

    secure: bool = False

    @abc.abstractmethod
    def bernoulli_indices(self, n: int, sampling_rate: float) -> torch.Tensor:
        """Indices in [0, n) each kept independently with probability q (sorted, int64)."""

    @abc.abstractmethod
    def permutation(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of range(n) (int64)."""

    @abc.abstractmethod
    def choice(self, n: int, k: int) -> torch.Tensor:
        """k distinct indices drawn uniformly without replacement from range(n) (int64)."""

    @abc.abstractmethod
    def integers(self, n: int, high: int) -> torch.Tensor:
        """n independent integers, each uniform on [0, high) (int64)."""

    @abc.abstractmethod
    def get_state(self) -> torch.Tensor | None:
        """A snapshot from which the stream continues identically (None if not reproducible)."""

    @abc.abstractmethod
    def set_state(self, state: torch.Tensor | None) -> None:
        """Continue the stream from a :meth:`get_state` snapshot."""


class TorchSource(RandomSource):
    """Draws from a ``torch.Generator``: reproducible, resumable, fast."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
        elif not isinstance(generator, torch.Generator):
            raise ValueError(
                f"generator must be a torch.Generator, got {type(generator).__name__}; "
                "pass torch.Generator().manual_seed(seed) for a reproducible run"
            )
        elif generator.device.type != "cpu":
            raise ValueError("generator must be a CPU torch.Generator (sampling runs on the CPU)")
        self.generator = generator

    def bernoulli_indices(self, n: int, sampling_rate: float) -> torch.Tensor:
        """Indices in [0, n) each kept independently with probability q (sorted, int64)."""
        draws = torch.empty(n, dtype=torch.int64).random_(0, _SCALE, generator=self.generator)
        # numpy's comparison and flatnonzero are several times faster than torch's on the CPU
        kept = np.flatnonzero(draws.numpy() < np.int64(_threshold(sampling_rate)))
        return torch.from_numpy(kept.astype(np.int64, copy=False))

    def permutation(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of range(n) (int64)."""
        return torch.randperm(n, generator=self.generator)

    def choice(self, n: int, k: int) -> torch.Tensor:
        """k distinct indices drawn uniformly without replacement from range(n) (int64)."""
        return torch.randperm(n, generator=self.generator)[:k]

    def integers(self, n: int, high: int) -> torch.Tensor:
        """n independent integers, each uniform on [0, high) (int64)."""
        return torch.randint(high, (n,), generator=self.generator, dtype=torch.int64)

    def get_state(self) -> torch.Tensor:
        """The generator's full state (a byte tensor)."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor | None) -> None:
        """Continue the stream from a :meth:`get_state` snapshot."""
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ValueError(
                "the random state must be a torch.uint8 tensor from a torch-generator sampler; "
                "this checkpoint was written by a secure (OS-random) sampler or is corrupt"
            )
        self.generator.set_state(state.clone())


class SecureSource(RandomSource):
    """Draws every decision from the OS CSPRNG; never reproducible, resumes by position only."""

    secure = True

    def __init__(self) -> None:
        self._system = random.SystemRandom()

    def bernoulli_indices(self, n: int, sampling_rate: float) -> torch.Tensor:
        """Indices in [0, n) each kept independently with probability q (sorted, int64)."""
        words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(64 - _BITS)
        kept = np.flatnonzero(words < np.uint64(_threshold(sampling_rate)))
        return torch.from_numpy(kept.astype(np.int64))

    def permutation(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of range(n) (exact Fisher–Yates on OS randomness)."""
        order = list(range(n))
        self._system.shuffle(order)
        return torch.tensor(order, dtype=torch.int64)

    def choice(self, n: int, k: int) -> torch.Tensor:
        """k distinct indices drawn uniformly without replacement from range(n)."""
        return torch.tensor(self._system.sample(range(n), k), dtype=torch.int64)

    def integers(self, n: int, high: int) -> torch.Tensor:
        """n independent integers, each uniform on [0, high) (exact, from OS randomness)."""
        return torch.tensor([self._system.randrange(high) for _ in range(n)], dtype=torch.int64)

    def get_state(self) -> None:
        """OS randomness has no state to save."""
        return None

    def set_state(self, state: torch.Tensor | None) -> None:
        """Accept only the stateless snapshot a secure sampler writes."""
        if state is not None:
            raise ValueError(
                "this sampler draws from the OS CSPRNG (secure=True) and cannot resume a "
                "torch-generator stream; load the checkpoint into a sampler with secure=False"
            )


def make_source(generator: torch.Generator | None = None, secure: bool = False) -> RandomSource:
    """Pick the source a sampler asked for; a generator and secure=True together are refused."""
    if secure:
        if generator is not None:
            raise ValueError(
                "secure=True draws from the OS CSPRNG and ignores any generator; pass one or "
                "the other, not both"
            )
        return SecureSource()
    return TorchSource(generator)
