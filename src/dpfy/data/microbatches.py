"""Microbatch membership drawn per example, so that adding a record moves no other example.

Microbatch clipping (guide alg. 3) clips the *average* gradient of each microbatch to C; one
record then changes one microbatch's clipped average, a sensitivity of 2C, only if the other
examples stay in their microbatches when it is added. Cutting the index-sorted batch into
consecutive slices breaks that (one added record shifts every later slice). Here every example
of a batch is put into one of M = ⌈B/k⌉ slots drawn uniformly and independently of the other
examples, so a neighbouring dataset changes exactly one slot's members.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpfy._validate import check_count
from dpfy.data.randomness import RandomSource


class MicrobatchSlots:
    """Draws each example's microbatch slot in [0, M), M = ⌈expected batch size / k⌉."""

    def __init__(self, expected_batch_size: float, microbatch_size: int, source: RandomSource):
        self.microbatch_size = check_count("microbatch_size", microbatch_size, minimum=1)
        self.slots = max(1, math.ceil(expected_batch_size / self.microbatch_size))
        self._source = source
        self._before = source.get_state()  # the stream before the last draw (see state_dict)

    def draw(self, examples: int) -> torch.Tensor:
        """One slot id per example (int64), each drawn independently and uniformly."""
        self._before = self._source.get_state()
        return self._source.integers(examples, self.slots)

    def state_dict(self, back: bool = False) -> dict[str, Any]:
        """The random stream, to resume the very slots an uninterrupted run would draw.

        ``back``: as it was before the last draw (its batch will be drawn again on resume).
        """
        return {"slots": self.slots, "rng": self._before if back else self._source.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream; a state for another number of slots is refused."""
        if not isinstance(state, dict) or state.get("slots") != self.slots:
            raise ValueError(
                f"microbatch state is for {state.get('slots') if isinstance(state, dict) else '?'}"
                f" slots, this run has {self.slots}; resume with the same microbatch_size"
            )
        self._source.set_state(state.get("rng"))
