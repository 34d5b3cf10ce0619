"""The parts of a run's facts besides accounting: dataset, model, training, tuning and results.

The trainer declares what dpfy cannot see (the dataset's name and preprocessing, what is
released, the unit of privacy, tuning and accuracy); :func:`model_facts` reads the model itself.
Each declared value has a fixed vocabulary, so the report can say it in a sentence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpfy._validate import check_count
from dpfy.report.json_codec import build, tuple_of

if TYPE_CHECKING:
    from torch import nn

# What the trainer may declare, each with the sentence the report prints.
RELEASES = {
    "final-model": "only the final model",
    "every-checkpoint": "every checkpoint saved during training",
}
UNITS = {
    "example": "example-level: one training example is the protected record",
    "user": "user-level: all examples of one user together are the protected record",
}
TUNING_DATA = {
    "none": "no hyperparameter tuning was run",
    "private": "hyperparameters were tuned on the private training data",
    "public": "hyperparameters were tuned on public data (declared by the trainer)",
}
# Loss normalisation of a sequence task → whether per-example gradient norms are independent of
# the sequence length (guide §5.4.1: average over target tokens).
LOSS_NORMALISATIONS = {
    "per-token-mean": True,  # each sequence's loss is averaged over its target tokens
    "per-example-mean": True,  # each example's loss is a mean over its own targets
    "per-sequence-sum": False,  # summed over tokens: the norm grows with the length
    "sum": False,  # summed over tokens and examples
}


def choice(name: str, value: str, choices: Iterable[str]) -> str:
    """Refuse a declared fact outside its vocabulary, listing the choices."""
    known = list(choices)
    if value not in known:
        raise ValueError(f"{name} must be one of {', '.join(known)}; got {value!r}")
    return value


@dataclass(frozen=True)
class PreprocessingStep:
    """One preprocessing step; steps learned from private data break DP unless public (§5.5.1)."""

    name: str
    description: str = ""
    fitted_on_private_data: bool = False
    declared_public: bool = False


@dataclass(frozen=True)
class PublicInput:
    """Something the run used that is public, not private: pretrained weights, a tokenizer.

    The guarantee covers only the private training data; what a run starts from must not depend
    on it, so the report names it and where it came from (guide §5.3.3).
    """

    role: str
    name: str
    source: str = ""
    version: str = ""

    def describe(self) -> str:
        """One phrase: role, name, and source and version when known."""
        origin = ", ".join(
            part for part in (self.source, self.version and f"version {self.version}") if part
        )
        return f"{self.role}: {self.name}" + (f" ({origin})" if origin else "")


@dataclass(frozen=True)
class DatasetFacts:
    """Which data was trained on and how it was prepared."""

    name: str
    size: int
    source: str = ""
    preprocessing: tuple[PreprocessingStep, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", check_count("size", self.size, minimum=1))
        object.__setattr__(self, "preprocessing", tuple(self.preprocessing))

    @classmethod
    def from_dict(cls, data: Any, where: str = "dataset") -> DatasetFacts:
        """Inverse of ``dataclasses.asdict``."""
        steps = tuple_of(PreprocessingStep, f"{where}.preprocessing")
        return build(cls, data, {"preprocessing": steps}, where)


@dataclass(frozen=True)
class LayerIssue:
    """A model layer a check flagged (batch-coupled or sparse), as plain text."""

    path: str
    layer: str
    problem: str
    fix: str


@dataclass(frozen=True)
class ModelFacts:
    """Parameter counts and the parts of the model that matter to the guarantee."""

    name: str
    parameters: int
    trainable: int
    frozen: int
    frozen_names: tuple[str, ...] = ()
    unnoised_trainable_names: tuple[str, ...] = ()
    sparse_layers: tuple[LayerIssue, ...] = ()
    batch_coupled_layers: tuple[LayerIssue, ...] = ()

    def __post_init__(self) -> None:
        for name in ("frozen_names", "unnoised_trainable_names"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("sparse_layers", "batch_coupled_layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def from_dict(cls, data: Any, where: str = "model") -> ModelFacts:
        """Inverse of ``dataclasses.asdict``."""
        converters = {
            name: tuple_of(LayerIssue, f"{where}.{name}")
            for name in ("sparse_layers", "batch_coupled_layers")
        }
        return build(cls, data, converters, where)


@dataclass(frozen=True)
class TrainingFacts:
    """What the trainer did and declares: optimizer, schedule, releases, unit, loss."""

    optimizer: str
    learning_rate: float | None
    steps_taken: int
    epochs: float
    released: str = "final-model"
    unit: str = "example"
    sequence_task: bool = False
    loss_normalisation: str | None = None

    def __post_init__(self) -> None:
        choice("released", self.released, RELEASES)
        choice("unit", self.unit, UNITS)
        if self.loss_normalisation is not None:
            choice("loss_normalisation", self.loss_normalisation, LOSS_NORMALISATIONS)


@dataclass(frozen=True)
class TuningFacts:
    """Hyperparameter tuning the trainer ran before this run (guide §5.4.2)."""

    data: str = "none"
    trials: int = 0
    #: Each hyperparameter the tuning chose at the edge of its grid, as a sentence: the best
    #: may lie beyond it, and tuning again spends budget too.
    grid_edges: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        choice("tuning data", self.data, TUNING_DATA)
        object.__setattr__(self, "trials", check_count("trials", self.trials))
        object.__setattr__(self, "grid_edges", tuple(str(edge) for edge in self.grid_edges))


@dataclass(frozen=True)
class ResultFacts:
    """Accuracy of the private model and, if the trainer ran one, of a non-private baseline."""

    accuracy: float | None = None
    baseline_accuracy: float | None = None
    evaluated_on: str = ""


def preprocessing_steps(value: Any) -> tuple[PreprocessingStep, ...]:
    """Steps from a list of :class:`PreprocessingStep` or a dataset's preprocessing record.

    A record (e.g. :class:`dpfy.data.preprocessing.Preprocessing`) has ``steps`` (names) and
    dataset-level ``fitted_on_private_data`` / ``declared_public`` flags; it becomes one step.
    """
    if value is None:
        return ()
    if hasattr(value, "fitted_on_private_data") and hasattr(value, "steps"):
        names = [str(step) for step in value.steps]
        return (
            PreprocessingStep(
                name=", ".join(names) or "preprocessing",
                description="; ".join(names),
                fitted_on_private_data=bool(value.fitted_on_private_data),
                declared_public=bool(getattr(value, "declared_public", False)),
            ),
        )
    steps = tuple(value)
    for step in steps:
        if not isinstance(step, PreprocessingStep):
            raise ValueError(f"preprocessing steps must be PreprocessingStep, got {step!r}")
    return steps


def model_facts(model: nn.Module, name: str, noised: Iterable[str] | None = None) -> ModelFacts:
    """Counts and flagged parts of ``model``; ``noised`` names the parameters the engine noises."""
    from dpfy.train.checks import find_batch_coupled_layers, find_sparse_gradient_layers

    params = dict(model.named_parameters())
    trainable = [n for n, p in params.items() if p.requires_grad]
    frozen = [n for n, p in params.items() if not p.requires_grad]
    noised_set = set(trainable if noised is None else noised)

    def issues(found: Iterable[Any]) -> tuple[LayerIssue, ...]:
        return tuple(LayerIssue(f.path, f.layer, f.problem, f.fix) for f in found)

    return ModelFacts(
        name=name,
        parameters=sum(p.numel() for p in params.values()),
        trainable=sum(params[n].numel() for n in trainable),
        frozen=sum(params[n].numel() for n in frozen),
        frozen_names=tuple(frozen),
        unnoised_trainable_names=tuple(n for n in trainable if n not in noised_set),
        sparse_layers=issues(find_sparse_gradient_layers(model)),
        batch_coupled_layers=issues(find_batch_coupled_layers(model)),
    )


__all__ = [
    "LOSS_NORMALISATIONS",
    "RELEASES",
    "TUNING_DATA",
    "UNITS",
    "DatasetFacts",
    "LayerIssue",
    "ModelFacts",
    "PreprocessingStep",
    "PublicInput",
    "ResultFacts",
    "TrainingFacts",
    "TuningFacts",
    "choice",
    "model_facts",
    "preprocessing_steps",
]
