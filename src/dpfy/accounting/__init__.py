"""Privacy accounting: events, RDP and PLD accountants, calibration, quick estimates.

Pure numpy/scipy: importing this package never imports torch.
"""

from dpfy.accounting.accountant import (
    ACCOUNTANTS,
    Accountant,
    UnsupportedEventError,
    compute_epsilon,
    make_accountant,
)
from dpfy.accounting.events import (
    ComposedEvent,
    DpEvent,
    FixedSizeSampledEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighbouringRelation,
    NoOpEvent,
    PoissonSampledEvent,
    PureDpEvent,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    TrialDistribution,
    dpsgd_event,
)

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "ComposedEvent",
    "DpEvent",
    "FixedSizeSampledEvent",
    "GaussianEvent",
    "LaplaceEvent",
    "NeighbouringRelation",
    "NoOpEvent",
    "PoissonSampledEvent",
    "PureDpEvent",
    "RepeatAndSelectEvent",
    "SelfComposedEvent",
    "TrialDistribution",
    "UnsupportedEventError",
    "compute_epsilon",
    "dpsgd_event",
    "make_accountant",
]
