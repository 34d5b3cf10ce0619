"""The query ledger of a served ensemble: every query accounted before it is answered.

Each query costs one data-independent event (the aggregator's ``query_event``), so ε after ``k``
queries depends on ``k`` alone: the ledger composes ``k`` such events with one of dpfy's
accountants and refuses any request that would take ε past the budget — before a vote is
counted, so a refused request releases nothing and changes nothing. Because the stopping point
is fixed by the budget and the settings, not by the data, refusing leaks nothing either.

Saved state is plain JSON bound to its ensemble (a fingerprint of the teachers and aggregator)
and sealed with a content digest; ε is always recomputed from the count and the settings, never
read back. The digest is integrity, not authentication: whoever can run dpfy can reseal an edited
file, and an earlier saved copy is a valid file — keep the ledger where only the server writes.
"""

from __future__ import annotations

from typing import Any

from dpfy._validate import check_count, check_delta, check_positive
from dpfy.access.prediction_aggregator import Aggregator, aggregator_from_spec
from dpfy.plan.accounting import NeighbouringRelation, SelfComposedEvent, make_accountant
from dpfy.train.budget_exhausted import BudgetExhausted
from dpfy.train.checkpoints import state_digest

LEDGER_FORMAT = "dpfy.query-ledger"
LEDGER_VERSION = 1

#: No server answers more queries than this; it bounds the search for the last query that fits.
MAX_QUERIES = 10**9


class QueryBudgetExhausted(BudgetExhausted):
    """A request would take ε past the ledger's budget; nothing was answered."""

    def __init__(self, ledger: QueryLedger, requested: int) -> None:
        self.requested, self.asked, self.remaining = requested, ledger.asked, ledger.remaining()
        self._refuse(
            ledger.epsilon(),
            ledger.budget,
            ledger.delta,
            f"query budget exhausted: the budget is ε={ledger.budget:g} at δ={ledger.delta:g}; "
            f"{ledger.asked} queries have been accounted ({ledger.answered} answered, ε spent "
            f"{ledger.epsilon():.4g}), and {requested} more would exceed it ({self.remaining} "
            "more fit). Nothing was answered for this request. To answer more, ask fewer queries, "
            "serve a new ensemble with a larger noise multiplier, or raise the budget if your "
            "privacy plan allows it.",
        )


class QueryLedger:
    """A query budget (ε, δ) and the queries spent from it, under one neighbouring relation."""

    def __init__(
        self,
        epsilon: float,
        delta: float,
        aggregator: Aggregator,
        *,
        accountant: str = "pld",
        relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
        binding: str = "",
    ) -> None:
        self.budget = check_positive("epsilon", epsilon)
        self.delta = check_delta(delta)
        self.aggregator = aggregator
        self.accountant = str(accountant)
        self.relation = NeighbouringRelation.parse(relation)
        self.binding = str(binding)
        self.asked = 0
        self.answered = 0
        self._cache: dict[int, float] = {}
        self.epsilon(1)  # an unknown accountant or unsupported event fails here, not mid-serving

    def epsilon(self, queries: int | None = None) -> float:
        """ε at the ledger's δ after ``queries`` queries (default: those accounted so far)."""
        k = self.asked if queries is None else check_count("queries", queries)
        if k not in self._cache:
            if k == 0:
                self._cache[k] = 0.0
            else:
                event = SelfComposedEvent(self.aggregator.query_event(), k)
                accountant = make_accountant(self.accountant, self.relation)
                self._cache[k] = accountant.compose(event).epsilon(self.delta)
        return self._cache[k]

    def fits(self, queries: int) -> bool:
        """Whether ``queries`` queries in all stay within the budget."""
        return queries <= MAX_QUERIES and self.epsilon(queries) <= self.budget

    def capacity(self) -> int:
        """The most queries the budget allows in all: exponential search, then bisection."""
        if not self.fits(1):
            return 0
        low, high = 1, 2
        while self.fits(high):
            low, high = high, min(2 * high, MAX_QUERIES + 1)
            if high > MAX_QUERIES:
                return MAX_QUERIES if self.fits(MAX_QUERIES) else self._bisect(low, MAX_QUERIES)
        return self._bisect(low, high)

    def _bisect(self, low: int, high: int) -> int:
        """The largest k in [low, high) that fits, given that low fits and high does not."""
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.fits(middle) else (low, middle)
        return low

    def remaining(self) -> int:
        """How many more queries fit in the budget."""
        return max(0, self.capacity() - self.asked)

    def charge(self, queries: int) -> None:
        """Account ``queries`` more before they are answered, or refuse them all unchanged."""
        queries = check_count("queries", queries)
        if not self.fits(self.asked + queries):
            raise QueryBudgetExhausted(self, queries)
        self.asked += queries

    def record_answered(self, answered: int) -> None:
        """Note how many of the charged queries got an answer (Confident-GNMax may decline)."""
        self.answered += check_count("answered", answered)
        if self.answered > self.asked:
            raise ValueError(f"{self.answered} answered but only {self.asked} queries accounted")

    # -- saved state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON, sealed with a digest of its content."""
        body = {
            "format": LEDGER_FORMAT,
            "version": LEDGER_VERSION,
            "epsilon": self.budget,
            "delta": self.delta,
            "aggregator": self.aggregator.spec(),
            "accountant": self.accountant,
            "relation": self.relation.value,
            "binding": self.binding,
            "asked": self.asked,
            "answered": self.answered,
        }
        return {**body, "digest": state_digest(body)}

    @classmethod
    def from_state_dict(cls, state: Any, binding: str) -> QueryLedger:
        """The ledger a state describes, refused unless intact and bound to ``binding``."""
        if not isinstance(state, dict) or state.get("format") != LEDGER_FORMAT:
            raise ValueError("not a dpfy query ledger (missing format marker); nothing was loaded")
        if state.get("version") != LEDGER_VERSION:
            raise ValueError(
                f"unsupported query ledger version {state.get('version')!r} (this dpfy reads "
                f"version {LEDGER_VERSION}); nothing was loaded"
            )
        body = {key: value for key, value in state.items() if key != "digest"}
        if state.get("digest") != state_digest(body):
            raise ValueError(
                "the query ledger's content does not match its digest: it was corrupted or "
                "edited after it was saved. Nothing was loaded — serve from an intact ledger"
            )
        if body.get("binding") != binding:
            raise ValueError(
                "this query ledger belongs to another ensemble (its binding does not match the "
                "teachers' fingerprint); nothing was loaded — load the ledger saved with this "
                "ensemble"
            )
        try:
            ledger = cls(
                body["epsilon"],
                body["delta"],
                aggregator_from_spec(body["aggregator"]),
                accountant=body["accountant"],
                relation=body["relation"],
                binding=binding,
            )
            ledger.asked = check_count("asked", body["asked"])
            ledger.record_answered(body["answered"])
        except KeyError as missing:
            raise ValueError(f"corrupt query ledger: missing field {missing}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"corrupt query ledger: {err}") from None
        if not ledger.fits(ledger.asked):
            raise ValueError(
                f"corrupt query ledger: {ledger.asked} queries exceed its own budget "
                f"ε={ledger.budget:g}; nothing was loaded"
            )
        return ledger

    def __repr__(self) -> str:
        return (
            f"QueryLedger(budget ε={self.budget:g}, δ={self.delta:g}, asked={self.asked}, "
            f"answered={self.answered}, ε spent={self.epsilon():.4g})"
        )
