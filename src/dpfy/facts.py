"""What a private training run actually did, frozen and saved as JSON for the report (guide §5.3.3).

The report card is generated from these facts, never typed by hand: :func:`collect_facts` reads
the run's settings, its ledger (ε, sampling, tuning events) and its model (frozen, sparse and
batch-coupled parts), and takes from the trainer only what dpfy cannot see itself — the dataset's
name and preprocessing, what is released, the unit of privacy, tuning and accuracy figures.

Every figure the report needs is computed here, once, while the run and its ledger are at hand:
ε per label, ε under the Poisson assumption, and a table of ε at a few standard δ under both the
PLD and the RDP accountant. :meth:`RunFacts.to_dict` / :meth:`RunFacts.from_dict` round-trip
through plain JSON (versioned), so ``dpfy report RUN_DIR`` re-renders a report from the saved file
without importing torch. This module imports torch and the ledger only inside
:func:`collect_facts` and :func:`record_clip_norms`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpfy._validate import check_count, check_delta, check_positive
from dpfy.settings import PrivacySettings

if TYPE_CHECKING:
    from torch import nn

    from dpfy.ledger import PrivacyLedger
    from dpfy.session import PrivateTraining

FACTS_FORMAT = "dpfy.run-facts"
FACTS_VERSION = 1

# δ values at which the report also states ε, beside the run's own δ (guide §5.3.3 asks for the
# full (ε, δ); several δ let readers compare with other work).
STANDARD_DELTAS = (1e-5, 1e-6, 1e-8)

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


def _choice(name: str, value: str, choices: dict[str, Any]) -> str:
    """Refuse a declared fact outside its vocabulary, listing the choices."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


# -- JSON helpers ---------------------------------------------------------------------------------

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def json_safe(value: Any) -> Any:
    """Plain JSON: tuples become lists, non-finite floats the strings 'inf', '-inf', 'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_restore(value: Any) -> Any:
    """Inverse of :func:`json_safe` for the non-finite floats (containers stay lists)."""
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, dict):
        return {k: json_restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_restore(v) for v in value]
    return value


def _build(cls: type, data: Any, nested: dict[str, Callable[[Any], Any]] | None = None) -> Any:
    """A dataclass from a dict with exactly its fields; ``nested`` converts sub-objects."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be a dict, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    converters = nested or {}
    values = {k: converters[k](v) if k in converters else v for k, v in data.items()}
    try:
        return cls(**values)
    except TypeError as err:
        raise ValueError(f"malformed {cls.__name__}: {err}") from None


def _tuple_of(cls: type) -> Callable[[Any], tuple[Any, ...]]:
    """Converter for a list of dataclass dicts."""
    return lambda items: tuple(_build(cls, item) for item in items)


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Converter that passes None through."""
    return lambda value: None if value is None else convert(value)


# -- the facts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreprocessingStep:
    """One preprocessing step; steps learned from private data break DP unless public (§5.5.1)."""

    name: str
    description: str = ""
    fitted_on_private_data: bool = False
    declared_public: bool = False


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
    def from_dict(cls, data: dict[str, Any]) -> ModelFacts:
        """Inverse of ``dataclasses.asdict``."""
        issues = _tuple_of(LayerIssue)
        return _build(cls, data, {"sparse_layers": issues, "batch_coupled_layers": issues})


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
        _choice("released", self.released, RELEASES)
        _choice("unit", self.unit, UNITS)
        if self.loss_normalisation is not None:
            _choice("loss_normalisation", self.loss_normalisation, LOSS_NORMALISATIONS)


@dataclass(frozen=True)
class TuningFacts:
    """Hyperparameter tuning the trainer ran before this run (guide §5.4.2)."""

    data: str = "none"
    trials: int = 0

    def __post_init__(self) -> None:
        _choice("tuning data", self.data, TUNING_DATA)
        object.__setattr__(self, "trials", check_count("trials", self.trials))


@dataclass(frozen=True)
class ResultFacts:
    """Accuracy of the private model and, if the trainer ran one, of a non-private baseline."""

    accuracy: float | None = None
    baseline_accuracy: float | None = None
    evaluated_on: str = ""


@dataclass(frozen=True)
class GradNormStats:
    """Per-example gradient norms before clipping, summarised (guide §5.4.1: C vs the norms)."""

    count: int
    max_grad_norm: float
    median: float
    p10: float
    p25: float
    p75: float
    p90: float
    maximum: float
    mean: float
    fraction_clipped: float

    @classmethod
    def from_norms(cls, norms: Iterable[float] | np.ndarray, max_grad_norm: float) -> GradNormStats:
        """Summarise unclipped per-unit norms collected during training against the clip norm C."""
        source = norms if isinstance(norms, np.ndarray) else list(norms)
        values = np.asarray(source, dtype=float).ravel()
        if values.size == 0:
            raise ValueError("no gradient norms were collected; run at least one non-empty step")
        clip = check_positive("max_grad_norm", max_grad_norm)
        p10, p25, p50, p75, p90 = np.quantile(values, [0.1, 0.25, 0.5, 0.75, 0.9])
        return cls(
            count=int(values.size),
            max_grad_norm=clip,
            median=float(p50),
            p10=float(p10),
            p25=float(p25),
            p75=float(p75),
            p90=float(p90),
            maximum=float(values.max()),
            mean=float(values.mean()),
            fraction_clipped=float(np.mean(values > clip)),
        )


@dataclass(frozen=True)
class EpsilonAtDelta:
    """Total ε at one δ under each accountant (None where it has no bound for these events)."""

    delta: float
    pld: float | None
    rdp: float | None


@dataclass(frozen=True)
class AccountingFacts:
    """The ledger's state and every ε the report prints, computed when the facts were collected."""

    ledger_state: dict[str, Any]
    summary: dict[str, Any]
    epsilon_under_poisson_assumption: float | None
    epsilon_table: tuple[EpsilonAtDelta, ...]
    notes: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AccountingFacts:
        """Inverse of ``dataclasses.asdict``."""
        return _build(cls, data, {"epsilon_table": _tuple_of(EpsilonAtDelta), "notes": tuple})


@dataclass(frozen=True)
class RunFacts:
    """Everything the privacy report states about one run; plain data, JSON round-trip."""

    dataset: DatasetFacts
    model: ModelFacts
    privacy: PrivacySettings
    training: TrainingFacts
    accounting: AccountingFacts
    software: dict[str, str]
    tuning: TuningFacts = field(default_factory=TuningFacts)
    results: ResultFacts = field(default_factory=ResultFacts)
    grad_norms: GradNormStats | None = None

    def to_dict(self) -> dict[str, Any]:
        """Versioned plain-JSON dict (non-finite floats as 'inf'/'-inf'/'nan')."""
        return {"format": FACTS_FORMAT, "version": FACTS_VERSION, **json_safe(asdict(self))}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunFacts:
        """Inverse of :meth:`to_dict`; any problem is a ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"run facts must be a dict, got {type(data).__name__}")
        if data.get("format") != FACTS_FORMAT or data.get("version") != FACTS_VERSION:
            raise ValueError(
                f"not version-{FACTS_VERSION} dpfy run facts (format={data.get('format')!r}, "
                f"version={data.get('version')!r})"
            )
        body = json_restore({k: v for k, v in data.items() if k not in ("format", "version")})
        dataset = {"preprocessing": _tuple_of(PreprocessingStep)}
        return _build(
            cls,
            body,
            {
                "dataset": lambda d: _build(DatasetFacts, d, dataset),
                "model": ModelFacts.from_dict,
                "privacy": lambda d: _build(PrivacySettings, d),
                "training": lambda d: _build(TrainingFacts, d),
                "accounting": AccountingFacts.from_dict,
                "tuning": lambda d: _build(TuningFacts, d),
                "results": lambda d: _build(ResultFacts, d),
                "grad_norms": _optional(lambda d: _build(GradNormStats, d)),
            },
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the facts as indented JSON (the file ``dpfy report`` reads)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunFacts:
        """Read facts written by :meth:`save`; a corrupt file is a ValueError."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"{path} does not exist") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from None
        return cls.from_dict(data)


def asdict(facts: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` (tuples stay tuples; :func:`json_safe` makes them lists)."""
    return dataclasses.asdict(facts)


# -- collecting -----------------------------------------------------------------------------------


def software_versions() -> dict[str, str]:
    """Versions of Python and the libraries the guarantee depends on (guide §5.3.3)."""
    versions = {"python": platform.python_version()}
    for package in ("dpfy", "torch", "numpy", "scipy", "matplotlib"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


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
    from dpfy.checks import find_batch_coupled_layers, find_sparse_gradient_layers

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


def _event_counts(ledger: PrivacyLedger) -> list[tuple[Any, int]]:
    """The ledger's composed events as (event, count) pairs, in order."""
    from dpfy.accounting.events import SelfComposedEvent

    pairs = []
    for event in ledger.events().events:
        if isinstance(event, SelfComposedEvent):
            pairs.append((event.event, event.count))
        else:
            pairs.append((event, 1))
    return pairs


def _epsilons(
    pairs: Sequence[tuple[Any, int]], accountant: str, relation: Any, deltas: Sequence[float]
) -> tuple[list[float | None], str | None]:
    """ε at each δ under one accountant, or Nones and the reason it has no bound."""
    from dpfy.accounting import UnsupportedEventError, make_accountant

    tracker = make_accountant(accountant, relation)
    try:
        for event, count in pairs:
            tracker.compose(event, count)
    except UnsupportedEventError as err:
        return [None] * len(deltas), f"{accountant.upper()}: {err}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a grid-edge RDP bound is loose, never unsound
        return [tracker.epsilon(d) for d in deltas], None


def _poisson_epsilon(ledger: PrivacyLedger) -> float | None:
    """The ledger's ε as if every step were Poisson-sampled, or None where that has no bound."""
    try:
        return ledger.epsilon_under_poisson_assumption()
    except ValueError:  # a replace-one ledger: no comparable Poisson figure
        return None


def accounting_facts(
    ledger: PrivacyLedger, deltas: Sequence[float] = STANDARD_DELTAS
) -> AccountingFacts:
    """The ledger's state and summary plus ε at several δ under PLD and RDP (guide §5.3.3)."""
    every = sorted({ledger.delta, *(check_delta(d) for d in deltas)}, reverse=True)
    pairs = _event_counts(ledger)
    columns, notes = {}, []
    for name in ("pld", "rdp"):
        columns[name], note = _epsilons(pairs, name, ledger.relation, every)
        if note is not None:
            notes.append(note)
    table = tuple(
        EpsilonAtDelta(d, columns["pld"][i], columns["rdp"][i]) for i, d in enumerate(every)
    )
    poisson = _poisson_epsilon(ledger)
    if poisson is None:
        notes.append(
            f"No ε under the Poisson assumption: Poisson sampling has no bound under "
            f"{ledger.relation.value} adjacency."
        )
    return AccountingFacts(
        ledger_state=ledger.state_dict(),
        summary=ledger.summary(),
        epsilon_under_poisson_assumption=poisson,
        epsilon_table=table,
        notes=tuple(notes),
    )


def collect_facts(
    training: PrivateTraining,
    *,
    dataset_name: str,
    model_name: str,
    dataset_source: str = "",
    preprocessing: Any = (),
    released: str = "final-model",
    unit: str | None = None,
    tuning: TuningFacts | None = None,
    results: ResultFacts | None = None,
    grad_norms: GradNormStats | None = None,
    sequence_task: bool = False,
    loss_normalisation: str | None = None,
    optimizer_name: str | None = None,
    learning_rate: float | None = None,
) -> RunFacts:
    """Assemble the facts of a finished (or stopped) run from the run itself and the trainer.

    ``unit`` defaults to the run's own unit of privacy (``"user"`` for user-level DP-SGD).
    """
    settings = training.settings
    unit = settings.unit if unit is None else unit
    wrapped = getattr(training.optimizer, "original_optimizer", training.optimizer)
    if learning_rate is None and wrapped.param_groups:
        learning_rate = float(wrapped.param_groups[0].get("lr", math.nan))
    steps_taken = training.ledger.steps
    return RunFacts(
        dataset=DatasetFacts(
            dataset_name,
            settings.examples or settings.dataset_size,  # user level: examples, not users
            dataset_source,
            preprocessing_steps(preprocessing),
        ),
        model=model_facts(training.model, model_name, training.engine.params),
        privacy=_build(PrivacySettings, dataclasses.asdict(settings)),
        training=TrainingFacts(
            optimizer=optimizer_name or type(wrapped).__name__,
            learning_rate=learning_rate,
            steps_taken=steps_taken,
            epochs=steps_taken * settings.expected_batch_size / settings.dataset_size,
            released=released,
            unit=unit,
            sequence_task=sequence_task,
            loss_normalisation=loss_normalisation,
        ),
        accounting=accounting_facts(training.ledger),
        software=software_versions(),
        tuning=tuning or TuningFacts(),
        results=results or ResultFacts(),
        grad_norms=grad_norms,
    )


class NormLog:
    """Unclipped per-unit gradient norms seen during training, for :class:`GradNormStats`."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []

    def add(self, norms: Any) -> None:
        """Keep one step's norms (a tensor or array)."""
        if hasattr(norms, "detach"):
            norms = norms.detach().cpu().numpy()
        self._chunks.append(np.asarray(norms, dtype=np.float64).ravel())

    @property
    def norms(self) -> np.ndarray:
        """All norms kept so far."""
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0)

    def stats(self, max_grad_norm: float) -> GradNormStats:
        """The summary the report prints."""
        return GradNormStats.from_norms(self.norms, max_grad_norm)


@contextlib.contextmanager
def record_clip_norms(training: PrivateTraining) -> Iterator[NormLog]:
    """Log the unclipped norms of every clipping the run's optimizer does inside the block.

    The engine computes these norms to clip; this only keeps them (they are statistics of private
    data, used for the report's clip-norm check and never fed back into training).
    """
    log = NormLog()
    observers = training.optimizer.clip_observers

    def observe(result: Any) -> None:
        log.add(result.norms)

    observers.append(observe)
    try:
        yield log
    finally:
        observers.remove(observe)


__all__ = [
    "FACTS_FORMAT",
    "FACTS_VERSION",
    "LOSS_NORMALISATIONS",
    "RELEASES",
    "STANDARD_DELTAS",
    "TUNING_DATA",
    "UNITS",
    "AccountingFacts",
    "DatasetFacts",
    "EpsilonAtDelta",
    "GradNormStats",
    "LayerIssue",
    "ModelFacts",
    "NormLog",
    "PreprocessingStep",
    "PrivacySettings",
    "ResultFacts",
    "RunFacts",
    "TrainingFacts",
    "TuningFacts",
    "accounting_facts",
    "collect_facts",
    "model_facts",
    "preprocessing_steps",
    "record_clip_norms",
    "software_versions",
]
