"""Prediction-level DP: a served ensemble that answers queries privately, against a budget.

The guide's §3.2 prediction-level access model: only the answers are released, never a model.
:meth:`PrivateEnsemble.fit` splits the private training data into disjoint partitions by a
fixed per-record rule, trains one non-private teacher on each, and :meth:`PrivateEnsemble.answer`
labels queries by private aggregation of the teachers' votes (GNMax or Confident-GNMax, Papernot
et al. 2018), each query accounted in a :class:`QueryLedger` before it is answered. The training
data is protected by the answers' ε; the teachers themselves are not private and must stay on
the server. The ε released is the data-independent one (see :mod:`.prediction_aggregator`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpfy._validate import check_count, check_seed
from dpfy.access.prediction_aggregator import (
    UNANSWERED,
    Aggregator,
    aggregator_from_spec,
    vote_histogram,
)
from dpfy.access.prediction_ledger import QueryLedger
from dpfy.access.prediction_partition import assign_partitions, partition_indices
from dpfy.access.prediction_teachers import teacher_votes, train_teachers
from dpfy.plan.accounting import NeighbouringRelation
from dpfy.train.checkpoints import save_atomically, state_digest
from dpfy.train.noise.source import NoiseSource, SecureNoise, TorchNoise

ENSEMBLE_FORMAT = "dpfy.private-ensemble"


def noise_source(seed: int | None) -> NoiseSource:
    """OS-secure noise, or seeded noise for experiments (replayable by anyone with the seed)."""
    return SecureNoise() if seed is None else TorchNoise(check_seed(seed))


class PrivateEnsemble:
    """Teachers on disjoint partitions behind a private aggregator and a query ledger."""

    def __init__(
        self,
        teachers: Sequence[nn.Module],
        aggregator: Aggregator,
        ledger: QueryLedger,
        *,
        num_classes: int,
        input_shape: Sequence[int],
        partition_seed: int,
        noise: NoiseSource | None = None,
    ) -> None:
        self.teachers = list(teachers)
        self.aggregator = aggregator
        self.num_classes = check_count("num_classes", num_classes, minimum=2)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.partition_seed = int(partition_seed)
        self.noise = noise if noise is not None else SecureNoise()
        _check_output_width(self.teachers, self.input_shape, self.num_classes)
        if ledger.binding != self.fingerprint():
            raise ValueError(
                "the query ledger is bound to another ensemble; build it with "
                "binding=ensemble.fingerprint() or load the ledger saved with these teachers"
            )
        self.ledger = ledger

    @classmethod
    def fit(
        cls,
        dataset: TensorDataset,
        make_model: Callable[[], nn.Module],
        *,
        teachers: int,
        aggregator: Aggregator,
        epsilon: float,
        delta: float,
        num_classes: int,
        epochs: int = 20,
        batch_size: int = 32,
        lr: float = 1e-2,
        seed: int | None = None,
        accountant: str = "pld",
        relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
    ) -> PrivateEnsemble:
        """Train ``teachers`` models on disjoint per-record partitions; budget (ε, δ) of answers.

        ``num_classes`` is given, not read off the labels (that would be a statistic of the
        private data). ``seed`` fixes partitions, initialisation and noise (experiments only);
        None draws the noise from the OS and fixes the public parts at seed 0.
        """
        features, labels = _training_tensors(dataset, num_classes)
        teachers = check_count("teachers", teachers, minimum=1)
        public = 0 if seed is None else check_seed(seed)
        assignment = assign_partitions(features, labels, teachers, public)
        models = train_teachers(
            make_model,
            features,
            labels,
            partition_indices(assignment, teachers),
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            seed=public,
        )
        fingerprint = _fingerprint(models, aggregator, num_classes, public)
        ledger = QueryLedger(
            epsilon,
            delta,
            aggregator,
            accountant=accountant,
            relation=relation,
            binding=fingerprint,
        )
        return cls(
            models,
            aggregator,
            ledger,
            num_classes=num_classes,
            input_shape=features.shape[1:],
            partition_seed=public,
            noise=noise_source(seed),
        )

    def fingerprint(self) -> str:
        """A digest of the teachers and settings: what the ledger is bound to."""
        return _fingerprint(self.teachers, self.aggregator, self.num_classes, self.partition_seed)

    def answer(self, queries: torch.Tensor) -> torch.Tensor:
        """Private labels for a batch of queries (UNANSWERED where Confident-GNMax declines).

        The whole batch is accounted first; a batch that does not fit raises
        :class:`~dpfy.access.prediction_ledger.QueryBudgetExhausted` before any vote is counted.
        """
        queries = self._checked(queries)
        self.ledger.charge(len(queries))
        histogram = vote_histogram(teacher_votes(self.teachers, queries), self.num_classes)
        labels = self.aggregator.aggregate(histogram, self.noise)
        self.ledger.record_answered(int((labels != UNANSWERED).sum()))
        return labels

    def _checked(self, queries: torch.Tensor) -> torch.Tensor:
        """A float batch of the ensemble's input shape, or one error naming the expected shape."""
        if not isinstance(queries, torch.Tensor) or tuple(queries.shape[1:]) != self.input_shape:
            shape = tuple(queries.shape) if isinstance(queries, torch.Tensor) else type(queries)
            raise ValueError(
                f"queries must be a tensor of shape (n, {', '.join(map(str, self.input_shape))})"
                f"; got {shape} — pass a batch, one row per query"
            )
        return queries.float()

    def epsilon(self, queries: int | None = None) -> float:
        """ε of ``queries`` queries (default: those answered so far) at the ledger's δ."""
        return self.ledger.epsilon(queries)

    def save(self, path: str | Path) -> Path:
        """Teachers and ledger in one owner-only file; the teachers are not private — never
        publish it."""
        return save_atomically(
            {
                "format": ENSEMBLE_FORMAT,
                "teachers": [t.state_dict() for t in self.teachers],
                "aggregator": self.aggregator.spec(),
                "num_classes": self.num_classes,
                "input_shape": list(self.input_shape),
                "partition_seed": self.partition_seed,
                "ledger": self.ledger.state_dict(),
            },
            Path(path),
        )

    @classmethod
    def load(
        cls, path: str | Path, make_model: Callable[[], nn.Module], *, seed: int | None = None
    ) -> PrivateEnsemble:
        """The saved ensemble, continuing its own ledger (refused if either was altered)."""
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != ENSEMBLE_FORMAT:
            raise ValueError(f"{path} is not a saved dpfy PrivateEnsemble; nothing was loaded")
        models = []
        for weights in state["teachers"]:
            model = make_model()
            model.load_state_dict(weights)
            models.append(model.eval())
        aggregator = aggregator_from_spec(state["aggregator"])
        fingerprint = _fingerprint(
            models, aggregator, state["num_classes"], state["partition_seed"]
        )
        ledger = QueryLedger.from_state_dict(state["ledger"], fingerprint)
        return cls(
            models,
            aggregator,
            ledger,
            num_classes=state["num_classes"],
            input_shape=state["input_shape"],
            partition_seed=state["partition_seed"],
            noise=noise_source(seed),
        )


@torch.no_grad()
def _check_output_width(
    teachers: Sequence[nn.Module], input_shape: tuple[int, ...], num_classes: int
) -> None:
    """Refuse teachers that can vote outside [0, num_classes), judged on a blank input.

    Checked once, on the architecture alone: a vote outside the classes found while answering
    would make whether a request errors depend on the private teachers.
    """
    probe = torch.zeros(2, *input_shape)
    for teacher in teachers:
        width = teacher(probe).shape[-1]
        if width != num_classes:
            raise ValueError(
                f"a teacher outputs {width} classes but the ensemble was given "
                f"num_classes={num_classes}; build the teachers with one output per class"
            )


def _fingerprint(
    teachers: Sequence[nn.Module], aggregator: Aggregator, num_classes: int, partition_seed: int
) -> str:
    """SHA-256 over every teacher's weights and the aggregation settings."""
    return state_digest(
        {
            "teachers": [t.state_dict() for t in teachers],
            "aggregator": aggregator.spec(),
            "num_classes": int(num_classes),
            "partition_seed": int(partition_seed),
        }
    )


def _training_tensors(
    dataset: TensorDataset, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and integer labels in [0, num_classes), or one error naming what to pass."""
    tensors = getattr(dataset, "tensors", None)
    if not isinstance(dataset, TensorDataset) or tensors is None or len(tensors) != 2:
        raise ValueError(
            "dataset must be a TensorDataset of (features, labels); got "
            f"{type(dataset).__name__} — wrap your tensors in torch.utils.data.TensorDataset"
        )
    features, labels = tensors
    num_classes = check_count("num_classes", num_classes, minimum=2)
    if labels.dim() != 1 or labels.dtype.is_floating_point:
        raise ValueError("labels must be a 1-d tensor of class indices (int64)")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"labels must be class indices in [0, {num_classes}); some are outside — pass the "
            "dataset's number of classes as num_classes"
        )
    return features, labels.long()
