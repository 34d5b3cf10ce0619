"""The privacy plan: everything privacy-relevant about a run, fixed before the first step.

Torch-free, so checkpoints, the cross-rank agreement check and reports read one object anywhere.
The resolver of its training variant (:mod:`dpfy.plan.variants`) makes it; training
components are chosen from it, and the ledger records what the sampler and engine then observed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpfy.plan.sampling import POISSON_KINDS, TREE_KINDS, SamplingKind, SamplingRecord
from dpfy.plan.tree_events import check_tree, resolve_restart

if TYPE_CHECKING:
    from dpfy.plan.correlated_events import Charges

#: The noise mechanisms a plan can name (each is registered in dpfy.train.noise.mechanisms;
#: the matrix-factorisation ones in dpfy.train.noise.banded and .blt).
MECHANISM_NAMES = ("gaussian", "tree-aggregation", "banded-mf", "blt")
#: The matrix-factorisation mechanisms (dpfy.plan.correlated_events): they hold a strategy.
FACTORISED_MECHANISMS = ("banded-mf", "blt")
#: The samplers whose steps a matrix-factorisation mechanism accounts (and only one does).
FACTORISED_SAMPLERS = (SamplingKind.FIXED_ORDER_EPOCHS.value, SamplingKind.CYCLIC_POISSON.value)


@dataclass(frozen=True)
class PrivacyPlan:
    """What a run was made private with; a checkpoint must match it exactly to resume.

    ``dataset_size`` and ``expected_batch_size`` count the sampled records: examples, or users in
    a user-level run. ``noise_multiplier`` σ is the noise std divided by the sensitivity.
    """

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
    #: The training algorithm: "dp-sgd", "dp-ftrl" (tree-aggregated noise), "bandmf" / "blt"
    #: (matrix-factorisation noise, :mod:`dpfy.plan.correlated_events`) or
    #: "dp-fedavg" / "dp-fedsgd" (each sampled user's model change after local training is what
    #: is clipped, dpfy.federated; guide alg. 2).
    algorithm: str = "dp-sgd"
    #: Whether sampling and noise came from a generator seeded with a value the caller chose
    #: (reproducible experiments). Anyone who knows the seed can replay the noise, so the ε holds
    #: only while the seed stays secret; unseeded runs draw from OS entropy.
    seeded: bool = False
    #: Processes that trained the run together (dpfy.train.distributed); 1 for one process.
    world_size: int = 1
    #: Which datasets are neighbours: "add-or-remove" (Poisson), "replace-one" (fixed-size
    #: sampling), "zero-out" (tree aggregation keeps the stream's order).
    relation: str = "add-or-remove"
    #: How each step's noise is drawn: "gaussian" (independent per step), "tree-aggregation"
    #: (correlated across the steps of a tree, DP-FTRL), or "banded-mf" / "blt" (C⁻¹z of a
    #: matrix factorisation); ``restart_every`` and ``tree`` are the tree's restart period in
    #: steps and its estimator ("plain" or "efficient").
    mechanism: str = "gaussian"
    restart_every: int | None = None
    tree: str | None = None
    #: The matrix-factorisation strategy, optimised when the plan was made: BandMF's Toeplitz
    #: coefficients (1, c_1, …, c_{b−1}), or a BLT's decays then weights (θ_1..θ_d, ω_1..ω_d).
    #: None for the other mechanisms.
    strategy: tuple[float, ...] | None = None
    #: Truncated Poisson sampling: M, the rows of every (padded) batch; None for the others.
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        """Refuse a plan whose noise mechanism, sampling and relation do not fit together.

        Tree aggregation is accounted per tree node under an order-keeping relation, and only
        over batches taken in order; independent Gaussian noise on batches taken in tree order
        would be charged nothing per step. A hand-built plan must meet the same rules as a
        resolver's.
        """
        tree_order = self.sampler in {kind.value for kind in TREE_KINDS}
        if self.strategy is not None:
            object.__setattr__(self, "strategy", tuple(float(v) for v in self.strategy))
        if self.mechanism not in MECHANISM_NAMES:
            raise ValueError(
                f"mechanism must be one of {', '.join(MECHANISM_NAMES)}; got {self.mechanism!r}"
            )
        if tree_order != (self.mechanism == "tree-aggregation"):
            raise ValueError(
                f"the {self.mechanism} mechanism does not fit sampler {self.sampler!r}: "
                "tree aggregation takes batches in tree order ('tree-shuffle', "
                "'tree-fixed-order') and they take tree aggregation"
            )
        factorised = self.mechanism in FACTORISED_MECHANISMS
        if factorised != (self.sampler in FACTORISED_SAMPLERS):
            raise ValueError(
                f"the {self.mechanism} mechanism does not fit sampler {self.sampler!r}: "
                "matrix-factorisation noise is accounted for batches in one order repeated "
                "every epoch ('fixed-order-epochs') or, BandMF only, cyclic Poisson groups "
                "('cyclic-poisson'), and those batches carry no event of their own without it"
            )
        truncated = self.sampler == SamplingKind.TRUNCATED_POISSON.value
        if truncated != (self.max_batch_size is not None):
            raise ValueError(
                "max_batch_size belongs to sampler='truncated-poisson' (which needs it): give "
                "both or neither"
            )
        if factorised:
            self._check_factorised()
        elif self.strategy is not None:
            raise ValueError("strategy belongs to the banded-mf and blt mechanisms; leave it None")
        if self.mechanism == "tree-aggregation":
            if self.relation == "add-or-remove":
                raise ValueError(
                    "tree aggregation keeps the stream's order, so it is accounted under "
                    "zero-out (or replace-one) adjacency, not add-or-remove"
                )
            check_tree(str(self.tree))
            resolve_restart(self.restart_every, self.dataset_size // self.expected_batch_size)
        elif self.restart_every is not None or self.tree is not None:
            raise ValueError("restart_every and tree belong to tree aggregation; leave them None")

    def _check_factorised(self) -> None:
        """A matrix-factorisation plan: order-keeping relation, one unit, a valid strategy."""
        from dpfy.plan.correlated_events import decode_strategy  # numpy/scipy: only when used

        if self.unit != "example":
            raise ValueError(f"the {self.mechanism} mechanism is planned per example only")
        strategy = decode_strategy(self.mechanism, self.strategy)
        if self.sampler == SamplingKind.CYCLIC_POISSON.value:
            groups = getattr(strategy, "bands", None)
            if self.mechanism != "banded-mf" or groups is None:
                raise ValueError("cyclic Poisson sampling amplifies BandMF only, not a BLT")
            if self.relation != "add-or-remove":
                raise ValueError(
                    "amplified BandMF is accounted under add-or-remove adjacency (Poisson "
                    f"sampling of its groups), not {self.relation}"
                )
            rate = groups * self.expected_batch_size / self.dataset_size
            if not 0.0 < self.sampling_rate <= 1.0 or abs(self.sampling_rate - rate) > 1e-12:
                raise ValueError(
                    f"amplified BandMF with {groups} groups samples each group at "
                    f"q = {groups}·B/N = {rate:.6g}, not {self.sampling_rate!r}"
                )
        elif self.relation == "add-or-remove":
            raise ValueError(
                f"{self.mechanism} noise over batches in a fixed order is accounted under "
                "zero-out (or replace-one) adjacency, not add-or-remove"
            )

    @property
    def sensitivity_factor(self) -> float:
        """Sensitivity in units of C: 2 for clipped microbatch averages (guide alg. 3), else 1."""
        return 1.0 if self.microbatch_size is None else 2.0

    @property
    def sensitivity(self) -> float:
        """How far one record can move the clipped sum: C, or 2C for microbatch averages."""
        return self.max_grad_norm * self.sensitivity_factor

    @property
    def noise_std(self) -> float:
        """Per-coordinate std of the noise on the clipped sum: σ · sensitivity."""
        return self.noise_multiplier * self.sensitivity

    @property
    def divisor(self) -> float:
        """The expected number of clipping units, B or B/k microbatches (never the realised)."""
        if self.microbatch_size is None:
            return float(self.expected_batch_size)
        return self.expected_batch_size / self.microbatch_size

    @property
    def clipping_unit(self) -> str:
        """What one clipped gradient covers: an example, a microbatch, or all of a user's data."""
        if self.unit == "user":
            return "user"
        return "example" if self.microbatch_size is None else "microbatch"

    def sampling_record(self) -> SamplingRecord:
        """The record the run's sampler must report: its kind, q, N and fixed batch size."""
        kind = SamplingKind.parse(self.sampler)
        return SamplingRecord(
            kind,
            self.sampling_rate,
            self.dataset_size,
            None
            if kind in POISSON_KINDS
            else self.max_batch_size or self.expected_batch_size,  # truncated Poisson: M
            unit=self.unit,
        )

    def charges(self) -> Charges:
        """What each step of a matrix-factorisation plan is charged, from its fields (the
        mechanism states it per step; the report words it)."""
        from dpfy.plan.correlated_events import run_charges  # numpy/scipy: only when used

        return run_charges(
            self.mechanism,
            self.strategy,
            self.sampler,
            self.steps,
            self.dataset_size,
            self.expected_batch_size,
        )
