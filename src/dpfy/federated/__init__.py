"""User-level DP by federated learning: DP-FedAvg / DP-FedSGD (guide alg. 2, §4.4).

:mod:`dpfy.federated.fedavg` trains in-process over simulated users, :mod:`~.simulation` runs it
with progress, :mod:`~.aggregate` holds the clip → sum → noise → ÷ B_c step both share with the
Flower adapter :mod:`dpfy.federated.flower` (imported on demand: it needs the ``flwr`` package).
"""

from dpfy._lazy import lazy_exports

# Lazy exports: ``dpfy.federated.config`` stays importable without torch (the CLI reads its
# defaults), so the torch-backed names load on first use.
_EXPORTS = {
    "SERVER_OPTIMIZERS": "dpfy.federated.aggregate",
    "ClippedSum": "dpfy.federated.aggregate",
    "MalformedUpdate": "dpfy.federated.aggregate",
    "ServerUpdate": "dpfy.federated.aggregate",
    "clip_update": "dpfy.federated.aggregate",
    "make_server_optimizer": "dpfy.federated.aggregate",
    "DPFedAvg": "dpfy.federated.fedavg",
    "FedAvgConfig": "dpfy.federated.fedavg",
    "RoundResult": "dpfy.federated.fedavg",
    "UserRoundSampler": "dpfy.federated.fedavg",
    "calibrate_user_noise": "dpfy.federated.fedavg",
    "check_user_datasets": "dpfy.federated.fedavg",
    "SimulationResult": "dpfy.federated.simulation",
    "simulate": "dpfy.federated.simulation",
    "FederatedConfig": "dpfy.federated.config",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
