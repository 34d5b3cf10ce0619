"""What DP-FTRL's tree aggregation costs, step by step and for a whole run (Kairouz et al. 2021).

Setting (App. D of the paper, guide §4.3): each epoch visits every example at most once, in any
order fixed independently of the data (a fixed order or a fresh shuffle); a tree is restarted
every ``restart_every`` steps, and ``restart_every`` divides the steps per epoch, so no tree ever
holds one example twice. Neighbouring datasets replace one example by a null one (zero-out) and
keep the stream's order.

Within an epoch the example in the worst place is the first one of the epoch's first tree: after
epoch position p it sits in ⌊log₂ min(p, k)⌋ + 1 released nodes (k = ``restart_every``), each
carrying N(0, σ²C²) while its gradient moves the node by at most C. The release so far is
therefore a Gaussian mechanism of noise multiplier σ/√(that count), and composing E epochs
multiplies the count by E. So a step releases exactly one new node that can hold a given
example's gradient when its epoch position is a power of two no larger than k, and none
otherwise (:func:`new_tree_nodes`); the ledger records one ``GaussianEvent(σ)`` per such node,
which adds up, after every step, to the tree bound — ``TreeAggregationEvent`` (the event
dp_accounting calls ``SingleEpochTreeAggregationDpEvent``) once per epoch.

Multiple participations of one example in one tree (no restarts across epochs) need the paper's
more delicate bound; dpfy refuses that configuration instead of guessing.
"""

from __future__ import annotations

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    GaussianEvent,
    NoOpEvent,
    SelfComposedEvent,
    TreeAggregationEvent,
)

#: The tree estimators (dpfy.train.noise.tree): the nodes as drawn, or Honaker's (2015).
TREE_ESTIMATORS = ("plain", "efficient")


def check_tree(tree: str) -> str:
    """A known tree estimator, or one error listing them."""
    if tree not in TREE_ESTIMATORS:
        raise ValueError(f"tree must be one of {', '.join(TREE_ESTIMATORS)}; got {tree!r}")
    return tree


def resolve_restart(restart_every: int | str | None, steps_per_epoch: int) -> int:
    """The tree length k: ``"epoch"``/None = one tree per epoch, or a divisor of the epoch.

    A tree longer than an epoch, or one that straddles an epoch boundary, could hold an example
    twice; dpfy has no proven bound for that, so it is refused with the fix.
    """
    steps_per_epoch = check_count("steps_per_epoch", steps_per_epoch, minimum=1)
    if restart_every is None or restart_every == "epoch":
        return steps_per_epoch
    message = (
        f"restart_every must be 'epoch' or a whole number of steps >= 1, got {restart_every!r}"
    )
    if isinstance(restart_every, (str, bool)):
        raise ValueError(message)
    try:
        k = check_count("restart_every", restart_every, minimum=1)
    except (TypeError, ValueError):
        raise ValueError(message) from None
    if steps_per_epoch % k:
        raise ValueError(
            f"restart_every={k} does not divide the {steps_per_epoch} steps of an epoch, so a tree "
            "would hold some examples twice, which dpfy cannot account (Kairouz et al. 2021 "
            "App. D covers one participation per tree): use restart_every='epoch' or a divisor "
            f"of {steps_per_epoch}"
        )
    return k


def new_tree_nodes(epoch_position: int, restart_every: int) -> int:
    """1 if step ``epoch_position`` (1-based) releases a new node holding a worst-case example."""
    p = check_count("epoch_position", epoch_position, minimum=1)
    k = check_count("restart_every", restart_every, minimum=1)
    return int(p <= k and p & (p - 1) == 0)


def charged_nodes(steps: int, steps_per_epoch: int, restart_every: int) -> int:
    """Σ of :func:`new_tree_nodes` over a run: depth(k) per full epoch, depth(min(r, k)) after."""
    steps = check_count("steps", steps)
    full, rest = divmod(steps, check_count("steps_per_epoch", steps_per_epoch, minimum=1))
    return full * restart_every.bit_length() + min(rest, restart_every).bit_length()


def ftrl_step_events(
    noise_multiplier: float, steps: int, steps_per_epoch: int, restart_every: int
) -> DpEvent:
    """Exactly what the ledger composes for the run: one GaussianEvent(σ) per charged node."""
    nodes = charged_nodes(steps, steps_per_epoch, restart_every)
    if nodes == 0:
        return NoOpEvent()
    return SelfComposedEvent(
        GaussianEvent(check_positive("noise_multiplier", noise_multiplier)), nodes
    )


def ftrl_tree_events(
    noise_multiplier: float, steps: int, steps_per_epoch: int, restart_every: int
) -> DpEvent:
    """The same run as tree-aggregation events: one per epoch (its trees), composed.

    Equal to :func:`ftrl_step_events` under RDP (both are α·nodes/(2σ²)); it is the form other
    libraries (dp_accounting) understand.
    """
    full, rest = divmod(check_count("steps", steps), steps_per_epoch)
    trees = steps_per_epoch // restart_every
    parts: list[DpEvent] = []
    if full:
        epoch = TreeAggregationEvent(noise_multiplier, (restart_every,) * trees)
        parts.append(SelfComposedEvent(epoch, full))
    if rest:
        sizes = (restart_every,) * (rest // restart_every) + (
            (rest % restart_every,) if rest % restart_every else ()
        )
        parts.append(TreeAggregationEvent(noise_multiplier, sizes))
    return ComposedEvent(tuple(parts))
