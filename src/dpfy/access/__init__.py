"""The guide's access models beyond full training (§3.2, table 1).

Label-only DP (the labels are private, the features public), prediction-level DP (only served
answers are released, the model never is) and input-level DP (the data is privatised before any
training). Full-training DP-SGD lives in :mod:`dpfy.train`.
"""

from dpfy._lazy import lazy_exports

#: Names served lazily (PEP 562), so importing this package stays torch-free until one is used.
_LAZY = {
    "PrivateEnsemble": "dpfy.access.prediction",
    "GNMax": "dpfy.access.prediction_aggregator",
    "ConfidentGNMax": "dpfy.access.prediction_aggregator",
    "QueryLedger": "dpfy.access.prediction_ledger",
    "QueryBudgetExhausted": "dpfy.access.prediction_ledger",
    "train_label_private": "dpfy.access.label_dp",
    "LabelPrivateResult": "dpfy.access.label_dp",
    "LabelLedger": "dpfy.access.label_ledger",
    "LabelBudgetExhausted": "dpfy.access.label_ledger",
    "randomized_response_with_prior": "dpfy.access.rr_prior",
    "InputRandomiser": "dpfy.access.input_dp",
    "FeatureBounds": "dpfy.access.input_dp",
}


__getattr__ = lazy_exports(__name__, _LAZY)
