"""What a private training run actually did, frozen and saved as JSON for the report (guide §5.3.3).

The report card is generated from these facts, never typed by hand: :func:`collect_facts` reads
the run's settings, its ledger (ε, sampling, tuning events) and its model (frozen, sparse and
batch-coupled parts), and takes from the trainer only what dpfy cannot see itself — the dataset's
name and preprocessing, what is released, the unit of privacy, tuning and accuracy figures.

Every figure the report needs is computed here, once, while the run and its ledger are at hand:
ε per label, ε under the Poisson assumption, and a table of ε at a few standard δ under both the
PLD and the RDP accountant. :meth:`RunFacts.to_dict` / :meth:`RunFacts.from_dict` round-trip
through plain JSON (versioned), so ``dpfy report RUN_DIR`` re-renders a report from the saved file.

A saved file is evidence, not authority: :meth:`RunFacts.load` refuses malformed or impossible
facts (δ outside (0, 1), σ ≤ 0, NaN, …) and, because a re-rendered report recomputes ε from the
stored events and never trusts a stored number, rebuilds the ledger from its stored events and
recomputes every ε with the stored accountant (:func:`recompute_accounting`); a stored figure
that disagrees is refused rather than printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpfy._validate import (
    check_count,
    check_delta,
    check_positive,
    check_range,
    check_sampling_rate,
)
from dpfy.plan.privacy_plan import PrivacyPlan

if TYPE_CHECKING:
    from torch import nn

    from dpfy.train.ledger import PrivacyLedger
    from dpfy.train.session import PrivateTraining

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


def _build(
    cls: type,
    data: Any,
    nested: dict[str, Callable[[Any], Any]] | None = None,
    where: str | None = None,
) -> Any:
    """A dataclass from a dict with exactly its fields; ``nested`` converts sub-objects.

    Every problem names the field (``where``), so a hand-edited file says what to restore.
    """
    at, prefix = (f" at {where}", f"{where}.") if where else ("", "")
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__} must be a dict, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields{at}: {sorted(unknown)}")
    required = {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = required - set(data)
    if missing:
        raise ValueError(f"malformed {cls.__name__}{at}: missing field(s) {sorted(missing)}")
    converters = nested or {}
    values = {}
    for key, value in data.items():
        values[key] = converters[key](value) if key in converters else value
        _check_type(f"{prefix}{key}", values[key], _field_types(cls)[key])
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"malformed {cls.__name__}{at}: {err}") from None


def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each field (this module uses postponed annotations)."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return _FIELD_TYPES[cls]


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _check_type(where: str, value: Any, hint: Any) -> None:
    """Refuse a value of the wrong JSON type before it reaches a renderer (a str as a count…)."""
    if hint is Any:
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        ok = isinstance(value, hint)
    elif origin is tuple:
        ok = isinstance(value, (tuple, list))
        if ok:
            for i, item in enumerate(value):
                _check_type(f"{where}[{i}]", item, args[0])
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        if ok:
            for key, item in value.items():
                _check_type(f"{where}.{key}", item, args[1])
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        wanted = getattr(hint, "__name__", str(hint))
        raise ValueError(f"{where} must be {wanted}, got {type(value).__name__} {value!r:.60}")


def _tuple_of(cls: type, where: str | None = None) -> Callable[[Any], tuple[Any, ...]]:
    """Converter for a list of dataclass dicts."""

    def convert(items: Any) -> tuple[Any, ...]:
        name = where or cls.__name__
        if not isinstance(items, list):
            raise ValueError(f"{name} must be a list, got {type(items).__name__}")
        return tuple(_build(cls, item, where=f"{name}[{i}]") for i, item in enumerate(items))

    return convert


def _list_as_tuple(value: Any) -> Any:
    """A JSON list as a tuple; anything else is left for the type check to name."""
    return tuple(value) if isinstance(value, list) else value


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
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> ModelFacts:
        """Inverse of ``dataclasses.asdict``."""
        converters = {
            name: _tuple_of(LayerIssue, f"{where}.{name}")
            for name in ("sparse_layers", "batch_coupled_layers")
        }
        return _build(cls, data, converters, where)


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
    def from_dict(cls, data: dict[str, Any], where: str = "accounting") -> AccountingFacts:
        """Inverse of ``dataclasses.asdict``."""
        table = _tuple_of(EpsilonAtDelta, f"{where}.epsilon_table")
        return _build(cls, data, {"epsilon_table": table, "notes": _list_as_tuple}, where)


@dataclass(frozen=True)
class RunFacts:
    """Everything the privacy report states about one run; plain data, JSON round-trip."""

    dataset: DatasetFacts
    model: ModelFacts
    privacy: PrivacyPlan
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
    def from_dict(cls, data: Any) -> RunFacts:
        """Inverse of :meth:`to_dict`; any problem is a ValueError naming the field.

        Structure, types and every input the report states (δ, σ, C, q, counts; no NaN or ∞)
        are checked here, so nothing impossible reaches a renderer; the ε figures are checked by
        :meth:`load`, which recomputes them from the stored ledger.
        """
        if not isinstance(data, dict):
            raise ValueError(f"run facts must be a JSON object, got {type(data).__name__}")
        if data.get("format") != FACTS_FORMAT or data.get("version") != FACTS_VERSION:
            raise ValueError(
                f"not version-{FACTS_VERSION} dpfy run facts (format={data.get('format')!r}, "
                f"version={data.get('version')!r})"
            )
        body = json_restore({k: v for k, v in data.items() if k not in ("format", "version")})
        _refuse_non_finite(body, "")
        dataset = {"preprocessing": _tuple_of(PreprocessingStep, "dataset.preprocessing")}
        facts = _build(
            cls,
            body,
            {
                "dataset": lambda d: _build(DatasetFacts, d, dataset, "dataset"),
                "model": ModelFacts.from_dict,
                "privacy": lambda d: _build(PrivacyPlan, d, where="privacy"),
                "training": lambda d: _build(TrainingFacts, d, where="training"),
                "accounting": AccountingFacts.from_dict,
                "tuning": lambda d: _build(TuningFacts, d, where="tuning"),
                "results": lambda d: _build(ResultFacts, d, where="results"),
                "grad_norms": _optional(lambda d: _build(GradNormStats, d, where="grad_norms")),
            },
        )
        _check_inputs(facts)
        return facts

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the facts as indented JSON (the file ``dpfy report`` reads)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunFacts:
        """Read facts written by :meth:`save`, with every ε recomputed from the stored ledger.

        A re-rendered report recomputes ε from the stored events and never trusts a stored
        number, so an edited file cannot print a guarantee its ledger does not give. A file that
        is unreadable, not UTF-8, not JSON, malformed, impossible (δ outside (0, 1), σ ≤ 0, NaN,
        …) or whose stored figures disagree with the recomputation (:func:`recompute_accounting`)
        is one ValueError naming the file, the field and the fix.
        """
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise ValueError(
                f"{path} does not exist; pass a run directory written by `dpfy train`"
            ) from None
        except OSError as err:
            raise ValueError(f"{path} cannot be read ({err.strerror or err}); {_RESTORE}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path} is not UTF-8 text (undecodable byte at offset {err.start}); {_RESTORE}"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); {_RESTORE}") from None
        except RecursionError:
            raise ValueError(
                f"{path} is nested too deeply to be dpfy run facts; {_RESTORE}"
            ) from None
        try:
            return recompute_accounting(cls.from_dict(data))
        except ValueError as err:
            raise ValueError(f"{path}: {err}; {_RESTORE}") from None


#: What every refusal of a saved file tells the user to do.
_RESTORE = "restore the facts.json the run wrote, or train the run again"
#: Why a stored figure is refused (said in docstrings and in every disagreement message).
RECOMPUTE_RULE = (
    "a re-rendered report recomputes ε from the stored events and never trusts a stored number"
)
# A recomputation from the same events repeats the same floating-point work, so only summation
# order in a newer numpy or scipy can move it; an edit that changes a printed figure cannot hide.
_RELATIVE_TOLERANCE = 1e-6

#: The samplers, algorithms and loss reductions a run's settings can name.
SAMPLERS = ("poisson", "shuffle", "fixed-size", "tree-shuffle", "tree-fixed-order")
ALGORITHMS = ("dp-sgd", "dp-ftrl", "dp-fedavg", "dp-fedsgd")
LOSS_REDUCTIONS = ("mean", "sum")

# Figures recomputed from the ledger on load (so compared there, not range-checked here).
_RECOMPUTED = (
    ".accounting.summary",
    ".accounting.epsilon_under_poisson_assumption",
    ".accounting.epsilon_table",
)


def _refuse_non_finite(value: Any, where: str) -> None:
    """No NaN or ∞ anywhere but in the ε figures, which an unbounded ε may legitimately be."""
    if where in _RECOMPUTED:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where.lstrip('.')} must be a finite number, got {value!r}")
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_non_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_non_finite(item, f"{where}[{i}]")


def _check_inputs(facts: RunFacts) -> None:
    """The ranges of every stored input the report states; no accountant is asked about them."""
    from dpfy.plan.accounting.accountant import ACCOUNTANTS

    p, t, m = facts.privacy, facts.training, facts.model
    check_count("privacy.dataset_size", p.dataset_size, minimum=1)
    check_count("privacy.expected_batch_size", p.expected_batch_size, minimum=1)
    check_sampling_rate(p.sampling_rate, "privacy.sampling_rate")
    check_count("privacy.steps", p.steps)
    check_positive("privacy.noise_multiplier", p.noise_multiplier)
    check_positive("privacy.max_grad_norm", p.max_grad_norm)
    check_delta(p.delta, "privacy.delta")
    if p.target_epsilon is not None:
        check_positive("privacy.target_epsilon", p.target_epsilon)
    _choice("privacy.accountant", p.accountant, dict.fromkeys(["pld", "rdp", *ACCOUNTANTS]))
    _choice("privacy.sampler", p.sampler, dict.fromkeys(SAMPLERS))
    _choice("privacy.loss_reduction", p.loss_reduction, dict.fromkeys(LOSS_REDUCTIONS))
    _choice("privacy.unit", p.unit, UNITS)
    _choice("privacy.algorithm", p.algorithm, dict.fromkeys(ALGORITHMS))
    for name in ("microbatch_size", "examples", "max_examples_per_user"):
        if getattr(p, name) is not None:
            check_count(f"privacy.{name}", getattr(p, name), minimum=1)
    check_count("privacy.world_size", p.world_size, minimum=1)
    check_count("training.steps_taken", t.steps_taken)
    check_range("training.epochs", t.epochs, 0.0, math.inf, low_open=False)
    for name in ("parameters", "trainable", "frozen"):
        check_count(f"model.{name}", getattr(m, name))
    if m.parameters != m.trainable + m.frozen:
        raise ValueError(
            f"model.parameters is {m.parameters} but model.trainable + model.frozen is "
            f"{m.trainable + m.frozen}"
        )
    g = facts.grad_norms
    if g is not None:
        check_count("grad_norms.count", g.count, minimum=1)
        check_positive("grad_norms.max_grad_norm", g.max_grad_norm)
        for name in ("median", "p10", "p25", "p75", "p90", "maximum", "mean"):
            check_range(f"grad_norms.{name}", getattr(g, name), 0.0, math.inf, low_open=False)
        check_range(
            "grad_norms.fraction_clipped", g.fraction_clipped, 0.0, 1.0, low_open=False,
            high_open=False,
        )  # fmt: skip
    for i, row in enumerate(facts.accounting.epsilon_table):
        check_delta(row.delta, f"accounting.epsilon_table[{i}].delta")


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


def _event_counts(ledger: PrivacyLedger) -> list[tuple[Any, int]]:
    """The ledger's composed events as (event, count) pairs, in order."""
    from dpfy.plan.accounting.events import SelfComposedEvent

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
    from dpfy.plan.accounting import UnsupportedEventError, make_accountant

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


def recompute_accounting(facts: RunFacts) -> RunFacts:
    """``facts`` with its accounting recomputed from the stored ledger events and accountant.

    A re-rendered report recomputes ε from the stored events and never trusts a stored number:
    the ledger is rebuilt from ``accounting.ledger_state`` (with every check it made when the
    steps were recorded), and its summary, ε under the Poisson assumption and ε table are
    computed afresh. A stored figure that disagrees beyond rounding, or settings the ledger's
    steps contradict (δ, accountant, σ, q, sampler, steps), is a ValueError naming the field;
    otherwise the returned facts carry only the recomputed figures.
    """
    from dpfy.train.ledger import PrivacyLedger

    stored = facts.accounting
    try:
        ledger = PrivacyLedger.from_state_dict(stored.ledger_state)
        fresh = accounting_facts(ledger, [row.delta for row in stored.epsilon_table])
    except (ValueError, ArithmeticError) as err:  # UnsupportedEventError is a ValueError too
        raise ValueError(f"accounting.ledger_state is not a usable ledger ({err})") from None
    under = f"under the {ledger.accountant} accountant ({RECOMPUTE_RULE})"
    for where, old, new in (
        ("accounting.summary", stored.summary, fresh.summary),
        (
            "accounting.epsilon_under_poisson_assumption",
            stored.epsilon_under_poisson_assumption,
            fresh.epsilon_under_poisson_assumption,
        ),
        (
            "accounting.epsilon_table",
            [asdict(row) for row in stored.epsilon_table],
            [asdict(row) for row in fresh.epsilon_table],
        ),
    ):
        problem = _disagreement(where, json_restore(json_safe(old)), json_restore(json_safe(new)))
        if problem is not None:
            raise ValueError(f"{problem} {under}")
    _check_settings_against(facts, fresh.ledger_state, ledger.steps)
    return dataclasses.replace(facts, accounting=fresh)


def _disagreement(where: str, stored: Any, fresh: Any) -> str | None:
    """The first place a stored figure differs from its recomputation, said for people.

    Numbers agree within a relative tolerance (and an unbounded ε only with ∞); strings and
    flags exactly; sentences (``description``) are prose, regenerated rather than compared.
    """
    if isinstance(fresh, dict) and isinstance(stored, dict):
        for key in [*fresh, *(k for k in stored if k not in fresh)]:
            if key == "description" and key in stored and key in fresh:
                continue
            problem = _disagreement(
                f"{where}.{key}", stored.get(key, _ABSENT), fresh.get(key, _ABSENT)
            )
            if problem is not None:
                return problem
        return None
    if isinstance(fresh, list) and isinstance(stored, list) and len(fresh) == len(stored):
        for i, (old, new) in enumerate(zip(stored, fresh, strict=True)):
            problem = _disagreement(f"{where}[{i}]", old, new)
            if problem is not None:
                return problem
        return None
    if _number(stored) and _number(fresh):
        if _close(stored, fresh):
            return None
    elif type(stored) is type(fresh) and stored == fresh:
        return None
    if fresh is _ABSENT:
        return f"{where} is {_show(stored)} but the stored ledger events give no such figure"
    return f"{where} is {_show(stored)} but the stored ledger events give {_show(fresh)}"


_ABSENT = object()


def _number(value: Any) -> bool:
    """An int or float, not a bool (JSON keeps the two apart)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _close(a: float, b: float) -> bool:
    """Equal within the recomputation tolerance; ∞ only equals ∞ and NaN equals nothing."""
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=_RELATIVE_TOLERANCE, abs_tol=1e-12)


def _show(value: Any) -> str:
    """A stored or recomputed value in a message."""
    if value is _ABSENT:
        return "missing"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and len(value) > 3:
        return f"a list of {len(value)}"
    return f"{value!r:.80}"


def _check_settings_against(facts: RunFacts, state: dict[str, Any], steps: int) -> None:
    """The settings the report prints must be the ones the ledger's steps were accounted with."""
    p, t = facts.privacy, facts.training
    ledger = "the stored ledger"
    pairs = [
        ("privacy.delta", p.delta, state["delta"], ledger),
        ("privacy.accountant", p.accountant, state["accountant"], ledger),
        ("privacy.target_epsilon", p.target_epsilon, state["target_epsilon"], ledger),
        ("training.steps_taken", t.steps_taken, steps, ledger),
    ]
    for i, entry in enumerate(state["entries"]):
        if "sampling" not in entry:
            continue  # a labelled release (tuning): its own event, not the run's settings
        record, at = entry["sampling"], f"accounting.ledger_state.entries[{i}]"
        pairs += [
            ("privacy.noise_multiplier", p.noise_multiplier, entry["noise_multiplier"], at),
            ("privacy.sampling_rate", p.sampling_rate, record["sampling_rate"], at),
            ("privacy.sampler", p.sampler, record["kind"], at),
            ("privacy.unit", p.unit, record.get("unit", "example"), at),
            ("privacy.dataset_size", p.dataset_size, record["dataset_size"], at),
        ]
    for where, mine, theirs, source in pairs:
        same = _close(mine, theirs) if _number(mine) and _number(theirs) else mine == theirs
        if not same:
            raise ValueError(
                f"{where} is {_show(mine)} but {source} accounted {_show(theirs)} "
                f"({RECOMPUTE_RULE})"
            )
    norms = facts.grad_norms
    if norms is not None and not _close(norms.max_grad_norm, p.max_grad_norm):
        raise ValueError(  # the diagnostics state how many norms were clipped at the run's C
            f"grad_norms.max_grad_norm is {_show(norms.max_grad_norm)} but the run clipped at "
            f"privacy.max_grad_norm = {_show(p.max_grad_norm)} ({RECOMPUTE_RULE})"
        )
    if t.steps_taken:
        epochs = [t.steps_taken * p.expected_batch_size / p.dataset_size]
        epochs.append(t.steps_taken * p.sampling_rate)  # federated runs count rounds × q
        if not any(_close(t.epochs, e) for e in epochs):
            raise ValueError(
                f"training.epochs is {_show(t.epochs)} but the {t.steps_taken} steps accounted "
                f"at B/N = {p.expected_batch_size}/{p.dataset_size} make {_show(epochs[0])} "
                f"({RECOMPUTE_RULE})"
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
    settings = training.plan
    unit = settings.unit if unit is None else unit
    wrapped = getattr(training.optimizer, "original_optimizer", training.optimizer)
    if learning_rate is None and wrapped.param_groups:
        lr = wrapped.param_groups[0].get("lr")  # None, not NaN: a saved file holds no NaN
        learning_rate = None if lr is None else float(lr)
    steps_taken = training.ledger.steps
    return RunFacts(
        dataset=DatasetFacts(
            dataset_name,
            settings.examples or settings.dataset_size,  # user level: examples, not users
            dataset_source,
            preprocessing_steps(preprocessing),
        ),
        model=model_facts(training.model, model_name, training.engine.params),
        privacy=_build(PrivacyPlan, dataclasses.asdict(settings)),
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
    "RECOMPUTE_RULE",
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
    "PrivacyPlan",
    "ResultFacts",
    "RunFacts",
    "TrainingFacts",
    "TuningFacts",
    "accounting_facts",
    "collect_facts",
    "model_facts",
    "preprocessing_steps",
    "recompute_accounting",
    "record_clip_norms",
    "software_versions",
]
