"""Which rows of the pass in hand are examples: the probes follow examples, never padding rows.

A truncated Poisson batch has M rows whose last ones are padding (copies of one dataset row,
weighted 0 in the step; :mod:`dpfy.data.padding`). A probe that followed a padding row would
check ``dataset[0]`` again and count it on the card as a probe of an example, so the probes draw
their rows among the examples only. The loader publishes the padding with the batch; under
virtual batching a forward pass holds one chunk of it (:class:`~dpfy.data.padding.Padding`
``chunk``).
"""

from __future__ import annotations

from collections.abc import Callable

from dpfy.data.padding import Padding
from dpfy.data.provenance import DrawnBatch

#: Why a pass is not probed when it does not hold the padded rows the loader handed out.
UNKNOWN_PADDING = (
    "the pass did not hold the padded batch the loader handed out, so which of its rows are "
    "padding is not known (the step is refused)"
)

#: Rows of a pass → how many leading rows are examples (None: not known).
ExampleCount = Callable[[int], "int | None"]


def all_rows(rows: int) -> int | None:
    """Without padding every row is an example."""
    return rows


class ExampleRows:
    """The example rows of the forward pass in hand, from the loader's record of its batch."""

    def __init__(
        self,
        current: Callable[[], DrawnBatch | None],
        chunk: Callable[[], tuple[int, int] | None] = lambda: None,
    ) -> None:
        self.current = current  # the batch the loader handed out last
        self.chunk = chunk  # the rows of it this pass holds (virtual batching), None: all

    def padding(self) -> Padding | None:
        """The padding marks of the rows in hand (None: the batch is not padded)."""
        batch = self.current()
        padding = None if batch is None else batch.padding
        span = self.chunk()
        if padding is None or span is None:
            return padding
        return padding.chunk(*span)

    def __call__(self, rows: int) -> int | None:
        """How many of the pass's first ``rows`` rows are examples (None: not the padded rows)."""
        padding = self.padding()
        if padding is None:
            return rows
        return padding.real if rows == padding.rows else None
