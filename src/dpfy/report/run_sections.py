"""Report items 8–9 (guide §5.3.3) and the rest: hyperparameters, software, pitfalls, the run
and its released results.

Nothing here states an un-noised statistic of the private data (released facts only): the pitfalls
are those of the detectors that read released or public facts, and the results are the released
model's held-out accuracy; the rest is :mod:`dpfy.report.diagnostics`'s file.
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
    """Each finding with severity, evidence and fix; a plain line when there are none.

    The same closing line always follows: the checks that read un-noised diagnostics report in
    the diagnostics file, whether or not they found anything.
    """
    lines = [] if data else ["No pitfalls found by dpfy's detectors."]
    for f in data:
        lines += [
            f"- **[{f['severity'].upper()}] {f['title']}** "
            f"(`{f['code']}`, guide {f['guide_section']})",
            f"  - Evidence: {f['evidence']}",
            f"  - Fix: {f['fix']}",
        ]
    return [*lines, "", _DIAGNOSTIC_CHECKS]


_DIAGNOSTIC_CHECKS = (
    "Checks that read un-noised statistics of the private data (the clip norm against the "
    "per-example gradient norms) report in diagnostics.md, not on this card."
)


@section("pitfalls", "Pitfalls", _render_pitfalls)
def pitfalls(
    facts: RunFacts, findings: tuple[Finding, ...], words: Wording
) -> list[dict[str, str]]:
    """What the detectors that read released or public facts found (guide §5.4–§5.5, tab. 5)."""
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


#: What the card says about the diagnostics file: always the same words, never its values, so
#: the card tells nothing about the private data through it.
DIAGNOSTICS_NOTE = (
    "Un-noised diagnostics of the private training data — per-example gradient norms before "
    "clipping and the clip-norm check that reads them, any non-private baseline, the loss and "
    "accuracy measured on private training batches — are kept in diagnostics.md and "
    "diagnostics.json beside this card (and in facts.json, the run's own record). They are "
    "outside the DP guarantee and are not part of this card: keep them with the private data."
)


def _render_results(data: dict[str, Any]) -> list[str]:
    """The released model's held-out accuracy, then where the diagnostics are."""
    return [data["statement"], "", f"*{data['diagnostics']}*"]


@section("results", "Results", _render_results)
def results(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """The released model's accuracy on held-out data; nothing measured on the private data.

    Why this figure may be published: the model is released (post-processing of the DP
    outputs), and its accuracy is measured on a held-out test split, not on the training data the
    guarantee protects; stating it beside (ε, δ) is how DP results are customarily reported. It
    is a statistic of the test split, which the guarantee does not cover: the test data must not
    be private, or it needs its own accounting. A non-private baseline, trained without noise on
    the private data, is not released by the mechanism; it is in the diagnostics file.
    """
    r = facts.results
    on = r.evaluated_on or "the held-out test split"
    if r.accuracy is None:
        statement = "No test accuracy was recorded for the released model."
    else:
        statement = (
            f"Test accuracy of the released model: {show_value(r.accuracy)}, measured on {on} "
            "(held out from the private training data; the guarantee covers the training data, "
            "not the test split)."
        )
    return {
        "accuracy": r.accuracy,
        "evaluated_on": on,
        "statement": statement,
        "diagnostics": DIAGNOSTICS_NOTE,
    }


SECTIONS = (hyperparameters, software, pitfalls, run, results)

__all__ = ["DIAGNOSTICS_NOTE", "SECTIONS"]
