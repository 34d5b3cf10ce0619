"""What a private training run actually did, collected once and saved as JSON (guide §5.3.3).

The report card is generated from these facts, never typed by hand: :func:`collect_facts` reads
the run's plan, its ledger (ε, sampling, tuning events) and its model (frozen, sparse and
batch-coupled parts), and takes from the trainer only what dpfy cannot see itself — the dataset's
name and preprocessing, what is released, the unit of privacy, tuning and accuracy figures.
:meth:`RunFacts.to_dict` / :meth:`RunFacts.from_dict` round-trip through plain JSON (versioned),
so ``dpfy report RUN_DIR`` re-renders a report from the saved file.

A saved file is evidence, not authority: :meth:`RunFacts.load` refuses malformed or impossible
facts (δ outside (0, 1), σ ≤ 0, NaN, …) and recomputes every ε from the stored ledger events
(:func:`recompute_accounting`); a stored figure that disagrees is refused
rather than printed. The parts of the facts live in :mod:`~dpfy.report.run_parts`,
:mod:`~dpfy.report.accounting` and :mod:`~dpfy.report.clip_norms`, and are importable from here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpfy._safe_io import atomic_write_text, read_bounded
from dpfy._validate import (
    check_count,
    check_delta,
    check_positive,
    check_range,
    check_sampling_rate,
)
from dpfy.audit.result import AuditResult
from dpfy.audit.scope import check_behaviour_checks
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.variants import variant_keys
from dpfy.report.access_facts import AccessFacts
from dpfy.report.accounting import (
    STANDARD_DELTAS,
    AccountingFacts,
    EpsilonAtDelta,
    LedgerSummary,
    SampledSteps,
    accounting_facts,
)
from dpfy.report.clip_norms import GradNormStats, NormLog, record_clip_norms
from dpfy.report.json_codec import asdict, build, json_restore, json_safe, optional, tuple_of
from dpfy.report.provenance import source_commit
from dpfy.report.recompute import RECOMPUTE_RULE, check_settings_against, recomputed_accounting
from dpfy.report.run_parts import (
    LOSS_NORMALISATIONS,
    RELEASES,
    TUNING_DATA,
    UNITS,
    DatasetFacts,
    LayerIssue,
    ModelFacts,
    PreprocessingStep,
    PublicInput,
    ResultFacts,
    TrainingFacts,
    TuningFacts,
    choice,
    model_facts,
    preprocessing_steps,
)
from dpfy.report.wording import SAMPLER_WORDING, wording_for

if TYPE_CHECKING:
    from dpfy.train.session import PrivateTraining

FACTS_FORMAT = "dpfy.run-facts"
# 2: the ledger summary is typed (LedgerSummary): each sampling record with its step count, and
# only the figures the report reads.
FACTS_VERSION = 2

#: The loss reductions a run's plan can name (samplers and algorithms: those the report words).
LOSS_REDUCTIONS = ("mean", "sum")


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
    public_inputs: tuple[PublicInput, ...] = ()  # pretrained weights, tokenizer: not private
    audits: tuple[AuditResult, ...] = ()  # empirical ε̂ beside the claim (dpfy audit)
    access: AccessFacts = field(default_factory=AccessFacts)  # guide §3.2: what ε protects
    #: What the run's own code was observed to do (collate, model, loss probed for coupled
    #: examples; state watched for writes outside the step): check → status, probes, detail.
    behaviour_checks: dict[str, dict[str, Any]] | None = None

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
        facts = build(
            cls,
            body,
            {
                "dataset": DatasetFacts.from_dict,
                "model": ModelFacts.from_dict,
                "privacy": lambda d: build(PrivacyPlan, d, where="privacy"),
                "training": lambda d: build(TrainingFacts, d, where="training"),
                "accounting": AccountingFacts.from_dict,
                "tuning": lambda d: build(TuningFacts, d, where="tuning"),
                "results": lambda d: build(ResultFacts, d, where="results"),
                "grad_norms": optional(lambda d: build(GradNormStats, d, where="grad_norms")),
                "public_inputs": tuple_of(PublicInput, "public_inputs"),
                "audits": tuple_of(AuditResult, "audits", AuditResult.from_dict),
                "access": AccessFacts.from_dict,
                "behaviour_checks": optional(check_behaviour_checks),
            },
        )
        _check_inputs(facts)
        return facts

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the facts as indented JSON (the file ``dpfy report`` reads)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunFacts:
        """Read facts written by :meth:`save`, with every ε recomputed from the stored ledger.

        A re-rendered report recomputes ε from the stored events and never trusts a stored
        number, so an edited file cannot print a guarantee its ledger does not give. A file that
        is unreadable, not UTF-8, not JSON, malformed, impossible (δ outside (0, 1), σ ≤ 0, NaN,
        …) or whose stored figures disagree with the recomputation is one ValueError naming the
        file, the field and the fix.
        """
        try:
            raw = read_bounded(Path(path), "facts")  # a FIFO or /dev/zero is refused
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


def recompute_accounting(facts: RunFacts) -> RunFacts:
    """``facts`` with its accounting recomputed from the stored ledger events and accountant.

    A re-rendered report recomputes ε from the stored events and never trusts a stored number: a
    stored figure that disagrees beyond rounding, or settings the ledger's steps contradict (δ,
    accountant, σ, q, sampler, steps), is a ValueError naming the field; otherwise the returned
    facts carry only the recomputed figures.
    """
    fresh = recomputed_accounting(facts.accounting)
    check_settings_against(facts.privacy, facts.training, facts.grad_norms, fresh)
    return dataclasses.replace(facts, accounting=fresh)


#: What every refusal of a saved file tells the user to do.
_RESTORE = "restore the facts.json the run wrote, or train the run again"

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
    choice("privacy.accountant", p.accountant, dict.fromkeys(["pld", "rdp", *ACCOUNTANTS]))
    choice("privacy.sampler", p.sampler, SAMPLER_WORDING)
    choice("privacy.loss_reduction", p.loss_reduction, LOSS_REDUCTIONS)
    choice("privacy.unit", p.unit, UNITS)
    choice("privacy.algorithm", p.algorithm, dict.fromkeys(a for a, _ in variant_keys()))
    try:
        wording_for(p)  # an algorithm at a unit of privacy the report cannot state
    except ValueError as err:
        raise ValueError(f"privacy: {err}") from None
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


# -- collecting -----------------------------------------------------------------------------------


def software_versions() -> dict[str, str]:
    """Versions of Python and the libraries the guarantee depends on, and dpfy's commit (§5.3.3)."""
    versions = {"python": platform.python_version()}
    for package in ("dpfy", "torch", "numpy", "scipy", "matplotlib"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
        if package == "dpfy":
            versions["dpfy commit"] = source_commit()
    return versions


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
    public_inputs: tuple[PublicInput, ...] = (),
) -> RunFacts:
    """Assemble the facts of a finished (or stopped) run from the run itself and the trainer.

    ``unit`` defaults to the run's own unit of privacy (``"user"`` for user-level DP-SGD);
    ``public_inputs`` names what the run started from that is public (pretrained weights and
    their tokenizer), for the report to state.
    """
    plan = training.plan
    unit = plan.unit if unit is None else unit
    wrapped = getattr(training.optimizer, "original_optimizer", training.optimizer)
    if learning_rate is None and wrapped.param_groups:
        lr = wrapped.param_groups[0].get("lr")  # None, not NaN: a saved file holds no NaN
        learning_rate = None if lr is None else float(lr)
    steps_taken = training.ledger.steps
    behaviour = getattr(training.optimizer, "behaviour", None)
    return RunFacts(
        dataset=DatasetFacts(
            dataset_name,
            plan.examples or plan.dataset_size,  # user level: examples, not users
            dataset_source,
            preprocessing_steps(preprocessing),
        ),
        model=model_facts(training.model, model_name, training.engine.params),
        privacy=build(PrivacyPlan, dataclasses.asdict(plan)),
        training=TrainingFacts(
            optimizer=optimizer_name or type(wrapped).__name__,
            learning_rate=learning_rate,
            steps_taken=steps_taken,
            epochs=steps_taken * plan.expected_batch_size / plan.dataset_size,
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
        public_inputs=tuple(public_inputs),
        behaviour_checks=None if behaviour is None else behaviour.summary(),
    )


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
    "LedgerSummary",
    "ModelFacts",
    "NormLog",
    "PreprocessingStep",
    "PrivacyPlan",
    "PublicInput",
    "ResultFacts",
    "RunFacts",
    "SampledSteps",
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
