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
    where: str | None = None
    skipped: str | None = None

    def passed(self) -> None:
        """One probe found each example's contribution independent of the others."""
        self.probes += 1

    def found(self, problem: str, where: str) -> None:
        """One probe found a coupling ``where`` (kept: the first is what the refusal names).

        ``problem`` is the refusal's full text (it quotes values of the private batch);
        ``where`` names only the code (the collate_fn, a module, the loss), for the card.
        """
        self.probes += 1
        if self.problem is None:
            self.problem, self.where = problem, where

    def skip(self, why: str) -> None:
        """The probe could not run on this batch (the first reason is kept for the card)."""
        if self.skipped is None:
            self.skipped = why

    def summary(self) -> dict[str, object]:
        """Status (passed / refused / not run), probe count and a detail line for the card.

        The detail names code and reasons only, never a value of the private data.
        """
        if self.problem is not None:
            detail = f"examples coupled in {self.where}"
            return {"status": "refused", "probes": self.probes, "detail": detail}
        if self.probes:
            return {"status": "passed", "probes": self.probes, "detail": self.skipped or ""}
        return {"status": "not run", "probes": 0, "detail": self.skipped or "no batch was probed"}
