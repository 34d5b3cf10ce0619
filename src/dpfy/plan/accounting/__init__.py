"""Privacy accounting: events, RDP and PLD accountants, calibration, quick estimates.

Pure numpy/scipy: importing this package never imports torch.
"""

from dpfy.plan.accounting.accountant import (
    ACCOUNTANTS,
    Accountant,
    UnsupportedEventError,
    compute_epsilon,
    make_accountant,
)
from dpfy.plan.accounting.approx import (
    advanced_composition,
    basic_composition,
    scaling_law_epsilon,
    scaling_law_noise_multiplier,
)
from dpfy.plan.accounting.calibrate import (
    CalibrationError,
    FixedRatioSetting,
    calibrate_noise_multiplier,
    max_steps,
    settings_at_fixed_ratio,
    smallest_noise_multiplier,
)
from dpfy.plan.accounting.events import (
    BallsInBinsEpochEvent,
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
    TreeAggregationEvent,
    TrialDistribution,
    dpsgd_event,
)
from dpfy.plan.accounting.pld import PldAccountant
from dpfy.plan.accounting.pld_discrete import PldPrecision
from dpfy.plan.accounting.rdp import GridEdgeWarning, RdpAccountant

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "BallsInBinsEpochEvent",
    "CalibrationError",
    "ComposedEvent",
    "DpEvent",
    "FixedRatioSetting",
    "FixedSizeSampledEvent",
    "GaussianEvent",
    "GridEdgeWarning",
    "LaplaceEvent",
    "NeighbouringRelation",
    "NoOpEvent",
    "PldAccountant",
    "PldPrecision",
    "PoissonSampledEvent",
    "PureDpEvent",
    "RdpAccountant",
    "RepeatAndSelectEvent",
    "SelfComposedEvent",
    "TreeAggregationEvent",
    "TrialDistribution",
    "UnsupportedEventError",
    "advanced_composition",
    "basic_composition",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "dpsgd_event",
    "make_accountant",
    "max_steps",
    "scaling_law_epsilon",
    "scaling_law_noise_multiplier",
    "settings_at_fixed_ratio",
    "smallest_noise_multiplier",
]
