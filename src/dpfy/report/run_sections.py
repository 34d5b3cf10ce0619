"""Report items 8–9 (guide §5.3.3) and the rest: hyperparameters, software, pitfalls, the run,
and the diagnostics that are not private.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from dpfy.report.sections import section, show_value
from dpfy.report.wording import unit_wording

if TYPE_CHECKING:
    from dpfy.report.facts import RunFacts
    from dpfy.report.pitfalls import Finding
    from dpfy.report.wording import Wording

_HYPERPARAMETERS = (
    ("dataset_size", "N", "training examples"),
    ("sampling_rate", "q", "sampling rate B/N"),
    ("expected_batch_size", "B", "expected batch size"),
    ("noise_multiplier", "σ", "noise multiplier"),
    ("max_grad_norm", "C", "clip norm"),
    ("steps", "T", "steps taken"),
    ("epochs", "E", "epochs = T·B/N"),
    ("optimizer", "", "optimizer"),
    ("learning_rate", "η", "learning rate"),
    ("microbatch_size", "k", "microbatch size (— = per-example clipping)"),
    ("loss_reduction", "", "loss reduction over the batch"),
    ("sampler", "", "batch sampler"),
)


def _render_hyperparameters(data: dict[str, Any]) -> list[str]:
    """A table: name, symbol, value (a user-level run relabels N, q and B and adds rows)."""
    unit = unit_wording(data.get("unit", "example"))
    labels = dict(unit.hyperparameter_labels)
    lines = ["| hyperparameter | symbol | value |", "|---|---|---|"]
    lines += [
        f"| {labels.get(key, label)} | {sym} | {show_value(data[key])} |"
        for key, sym, label in _HYPERPARAMETERS + unit.hyperparameter_rows
    ]
    return lines


@section("hyperparameters", "8. Hyperparameters", _render_hyperparameters)
def hyperparameters(
    facts: RunFacts, findings: tuple[Finding, ...], words: Wording
) -> dict[str, Any]:
    """N, q, B, σ, C, steps, epochs, optimizer and learning rate (guide §5.4.1)."""
    p, t = facts.privacy, facts.training
    table = {
        "dataset_size": p.dataset_size,
        "sampling_rate": p.sampling_rate,
        "expected_batch_size": p.expected_batch_size,
        "noise_multiplier": p.noise_multiplier,
        "max_grad_norm": p.max_grad_norm,
        "steps": t.steps_taken,
        "epochs": t.epochs,
        "optimizer": t.optimizer,
        "learning_rate": t.learning_rate,
        "microbatch_size": p.microbatch_size,
        "loss_reduction": p.loss_reduction,
        "sampler": p.sampler,
    }
    if words.unit.groups_examples:  # what one record (a user) is
        table |= {
            "unit": p.unit,
            "examples": p.examples,
            "max_examples_per_user": p.max_examples_per_user,
        }
    return table


def _render_software(data: dict[str, str]) -> list[str]:
    """One bullet per package."""
    return [f"- {name} {version}" for name, version in data.items()]


@section("software", "9. Software", _render_software)
def software(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, str]:
    """Library versions the run used (guide §5.3.3: code and libraries)."""
    return dict(facts.software)


def _render_pitfalls(data: list[dict[str, str]]) -> list[str]:
    """Each finding with severity, evidence and fix; a plain line when there are none."""
    if not data:
        return ["No pitfalls found by dpfy's detectors."]
    lines = []
    for f in data:
        lines += [
            f"- **[{f['severity'].upper()}] {f['title']}** "
            f"(`{f['code']}`, guide {f['guide_section']})",
            f"  - Evidence: {f['evidence']}",
            f"  - Fix: {f['fix']}",
        ]
    return lines


@section("pitfalls", "Pitfalls", _render_pitfalls)
def pitfalls(
    facts: RunFacts, findings: tuple[Finding, ...], words: Wording
) -> list[dict[str, str]]:
    """What the registered detectors found (guide §5.4–§5.5, tab. 5)."""
    return [f.to_dict() for f in findings]


def _render_run(data: dict[str, Any]) -> list[str]:
    """Dataset and model in a few bullets."""
    d, m = data["dataset"], data["model"]
    lines = [
        f"- Dataset: {d['name']}, N = {d['size']}"
        + (f", from {d['source']}" if d["source"] else ""),
        f"- Model: {m['name']}, {m['parameters']:,} parameters "
        f"({m['trainable']:,} trained with DP, {m['frozen']:,} frozen)",
    ]
    for step in d["preprocessing"]:
        origin = (
            "declared public"
            if step["declared_public"]
            else ("fitted on the private data" if step["fitted_on_private_data"] else "fixed")
        )
        detail = "" if _repeats(step["name"], step["description"]) else f" — {step['description']}"
        lines.append(f"- Preprocessing ({origin}): {step['name']}{detail}")
    return lines


def _repeats(name: str, description: str) -> bool:
    """Whether a step's description only restates its name (a dataset record gives both)."""
    return not description.strip() or description.replace("; ", ", ") == name


@section("run", "Run", _render_run)
def run(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """Which data and model the claim is about."""
    m = facts.model
    return {
        "dataset": asdict(facts.dataset),
        "model": {
            "name": m.name,
            "parameters": m.parameters,
            "trainable": m.trainable,
            "frozen": m.frozen,
        },
    }


_NOT_PRIVATE = (
    "These figures are computed from data without noise and are NOT covered by the DP guarantee "
    "(gradient norms come from the private training data); use them to diagnose the run and "
    "leave them out of anything published."
)


def _render_diagnostics(data: dict[str, Any]) -> list[str]:
    """Accuracy and gradient-norm statistics, with the not-private warning first."""
    lines = [f"*{data['not_private']}*", ""]
    on = f" on {data['evaluated_on']}" if data["evaluated_on"] else ""
    lines.append(f"- accuracy of the private model{on}: {show_value(data['accuracy'])}")
    lines.append(
        f"- accuracy of the non-private baseline{on}: {show_value(data['baseline_accuracy'])}"
    )
    norms, clipped = data["grad_norms"], data.get("clipped", "per-example gradient")
    if norms is None:
        lines.append(f"- {clipped} norms: not collected")
    else:
        lines.append(
            f"- {clipped} norms before clipping ({norms['count']} values): median "
            f"{norms['median']:.4g}, 10–90% [{norms['p10']:.4g}, {norms['p90']:.4g}], max "
            f"{norms['maximum']:.4g}; {norms['fraction_clipped']:.1%} clipped at C = "
            f"{norms['max_grad_norm']:g}"
        )
    return lines


@section("diagnostics", "Diagnostics (not differentially private)", _render_diagnostics,
         diagnostic=True)  # fmt: skip
def diagnostics(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """Accuracy and gradient-norm statistics for the engineer, marked as not private."""
    r = facts.results
    return {
        "not_private": _NOT_PRIVATE,
        "accuracy": r.accuracy,
        "baseline_accuracy": r.baseline_accuracy,
        "evaluated_on": r.evaluated_on,
        "grad_norms": None if facts.grad_norms is None else asdict(facts.grad_norms),
        "clipped": f"per-{facts.privacy.clipping_unit} {words.algorithm.clipped}",
    }


SECTIONS = (hyperparameters, software, pitfalls, run, diagnostics)

__all__ = ["SECTIONS"]
