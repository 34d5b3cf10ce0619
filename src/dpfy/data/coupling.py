"""What the independence probes found: a refusal when examples are coupled, and a tally per check.

A step's clipping bounds one example's influence only if what the example contributes depends on
that example alone (guide §5.5.1 names batch normalisation; a loss normalised over the batch, a
collate_fn with batch statistics or a layer fed a slice of the batch break it the same way). The
probes observe behaviour; this module holds what they report.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfy.data.provenance import BatchRefused


class ExamplesCoupled(BatchRefused):
    """An example's contribution depended on the other examples of its batch; nothing changed."""


@dataclass
class CheckTally:
    """One probe's record over a run: how often it ran, the first coupling, why it did not run."""

    name: str
    probes: int = 0
    problem: str | None = None
    skipped: str | None = None

    def passed(self) -> None:
        """One probe found each example's contribution independent of the others."""
        self.probes += 1

    def found(self, problem: str) -> None:
        """One probe found a coupling (kept: the first is what the refusal names)."""
        self.probes += 1
        if self.problem is None:
            self.problem = problem

    def skip(self, why: str) -> None:
        """The probe could not run on this batch (the first reason is kept for the card)."""
        if self.skipped is None:
            self.skipped = why

    def summary(self) -> dict[str, object]:
        """Status (passed / refused / not run), probe count and a detail line for the card."""
        if self.problem is not None:
            return {"status": "refused", "probes": self.probes, "detail": self.problem}
        if self.probes:
            return {"status": "passed", "probes": self.probes, "detail": self.skipped or ""}
        return {"status": "not run", "probes": 0, "detail": self.skipped or "no batch was probed"}
