"""The one base of every budget refusal, so a caller can catch them all with one ``except``.

Training steps, federated rounds, served queries and label releases each refuse what would take ε
past a budget, before anything happens; each refusal subclasses :class:`BudgetExhausted` and
keeps its own name and wording. Torch-free, like the ledgers that raise it.
"""

from __future__ import annotations

__all__ = ["BudgetExhausted"]


class BudgetExhausted(RuntimeError):
    """One more step would take ε past the target; nothing was applied.

    The base of every budget refusal in dpfy, so ``except dpfy.BudgetExhausted`` catches each of
    them: a training step or federated round refused by the ledger's guard (this class itself), a
    served query (:class:`~dpfy.access.prediction_ledger.QueryBudgetExhausted`) and a label
    release (:class:`~dpfy.access.label_ledger.LabelBudgetExhausted`). Every one carries the ε
    ``spent`` so far, the ``target`` ε and the ``delta`` both are stated at.
    """

    spent: float
    target: float
    delta: float

    def __init__(self, spent: float, target: float, delta: float, step: str) -> None:
        self._refuse(
            spent,
            target,
            delta,
            f"privacy budget exhausted: ε spent so far is {spent:.6g} at δ={delta:g}, and one "
            f"more step ({step}) would take it past the target ε={target:.6g}. Nothing was "
            "applied. To continue, lower the number of steps, raise the noise multiplier σ, or "
            "raise the budget (a larger target_epsilon, if your privacy plan allows it).",
        )

    def _refuse(self, spent: float, target: float, delta: float, message: str) -> None:
        """Set what every refusal carries; each subclass words its own ``message``."""
        self.spent, self.target, self.delta = spent, target, delta
        RuntimeError.__init__(self, message)
