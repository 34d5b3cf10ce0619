"""User-level DP by federated learning: DP-FedAvg / DP-FedSGD (guide alg. 2, §4.4).

:mod:`dpfy.federated.fedavg` trains in-process over simulated users, :mod:`~.simulation` runs it
with progress, :mod:`~.aggregate` holds the clip → sum → noise → ÷ B_c step both share with the
Flower adapter :mod:`dpfy.federated.flower` (imported on demand: it needs the ``flwr`` package).
"""

import importlib
from typing import Any

# Lazy exports: ``dpfy.federated.config`` stays importable without torch (the CLI reads its
# defaults), so the torch-backed names load on first use.
_EXPORTS = {
    "SERVER_OPTIMIZERS": "aggregate",
    "ClippedSum": "aggregate",
    "MalformedUpdate": "aggregate",
    "ServerUpdate": "aggregate",
    "clip_update": "aggregate",
    "make_server_optimizer": "aggregate",
    "DPFedAvg": "fedavg",
    "FedAvgConfig": "fedavg",
    "RoundResult": "fedavg",
    "UserRoundSampler": "fedavg",
    "calibrate_user_noise": "fedavg",
    "check_user_datasets": "fedavg",
    "SimulationResult": "simulation",
    "simulate": "simulation",
    "FederatedConfig": "config",
}


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first access."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dpfy.federated' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dpfy.federated.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
