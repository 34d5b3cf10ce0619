"""The settings a run was made private with: torch-free, so reports can load them anywhere."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrivacySettings:
    """The settings a run was made private with; a checkpoint must match them to resume."""

    dataset_size: int
    expected_batch_size: int
    sampling_rate: float
    steps: int
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    target_epsilon: float | None
    accountant: str
    sampler: str
    microbatch_size: int | None
    loss_reduction: str
    #: User-level runs (guide §2.1, §4.4): ``dataset_size`` and ``expected_batch_size`` then count
    #: users; ``examples`` is the number of training examples they hold together, and
    #: ``max_examples_per_user`` caps how many of a sampled user's examples one step uses.
    unit: str = "example"
    examples: int | None = None
    max_examples_per_user: int | None = None
    #: The training algorithm: "dp-sgd", "dp-ftrl" (tree-aggregated noise, dpfy.train.ftrl) or
    #: "dp-fedavg" / "dp-fedsgd" (each sampled user's model change after local training is what
    #: is clipped, dpfy.federated; guide alg. 2).
    algorithm: str = "dp-sgd"
    #: Whether sampling and noise came from a generator seeded with a value the caller chose
    #: (reproducible experiments). Anyone who knows the seed can replay the noise, so the ε holds
    #: only while the seed stays secret; unseeded runs draw from OS entropy.
    seeded: bool = False
    #: Processes that trained the run together (dpfy.train.distributed); 1 for one process.
    world_size: int = 1

    @property
    def sensitivity_factor(self) -> float:
        """Sensitivity in units of C: 2 for clipped microbatch averages (guide alg. 3), else 1."""
        return 1.0 if self.microbatch_size is None else 2.0
