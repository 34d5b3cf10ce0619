"""The privacy report card: every item of the guide's §5.3.3 list, derived from a run's facts.

:func:`build_report` turns :class:`~dpfy.report.facts.RunFacts` into a :class:`ReportCard`; nothing
in it
is typed by hand. Each section is built by one registered function, and the Markdown is rendered
from the same JSON the card exports, so the two never disagree. Re-rendering needs only the saved
facts: :func:`render_run` reads ``RUN_DIR/facts.json`` that :func:`write_report` wrote beside
``report.md``, ``report.json`` and the PNG plots; a re-rendered report recomputes ε from the stored
events and never trusts a stored number, so an edited file is refused, not printed. Diagnostics
(accuracy, gradient-norm statistics) are computed without noise and are marked as not private;
``diagnostics=False`` drops them for publication.

JSON schema (``ReportCard.to_json()``; keys are stable, version 1; ε values are numbers, or the
strings "inf"/"nan" when unbounded, or null where not applicable)::

    format: "dpfy.report.render", version: 1
    title: str                                      "Privacy report: MODEL on DATASET"
    headline: str                                   one-paragraph claim, honest about assumptions
    dp_setting:      {model: "central", curator: "trusted", statement}                   §3.1
    released:        {outputs: "final-model" | "every-checkpoint", statement}            §2.2
    unit_of_privacy: {unit: "example" | "user", statement}                               §2.1
    neighbouring_relation: {relation, statement, comparability}                          §2.1
    accounting:      {accountant, delta, sampling_rate, noise_multiplier, max_grad_norm,
                      steps, planned_steps, expected_batch_size, dataset_size, sampler,
                      sampler_description, sensitivity, noise_std, statement}            §4.2
    assumptions:     {all_met,
                      sampling: {kind, poisson, met, statement},
                      noise_on_every_trainable_parameter: {met, noised_values, statement},
                      frozen_parameters: {tensors, values, names, statement},
                      clipping: {unit, microbatch_size, sensitivity_in_c, statement}}     §4.3
    epsilon:         {delta, accountant, training, tuning, tuning_statement, other,
                      total, target_epsilon, assumptions_met, under_poisson_assumption
                      (null for DP-FTRL, which assumes no sampling), proven_total,
                      statement}                                                         §5.4.2
    epsilon_table:   {rows: [{delta, pld, rdp}], notes: [str], statement}
    hyperparameters: {dataset_size, sampling_rate, expected_batch_size, noise_multiplier,
                      max_grad_norm, steps, epochs, optimizer, learning_rate,
                      microbatch_size, loss_reduction, sampler}                          §5.4.1
    software:        {python, dpfy, torch, numpy, scipy, matplotlib, ...}                §5.3.3
    pitfalls:        [{code, severity, title, evidence, fix, guide_section}]             §5.4–5.5
    run:             {dataset: {name, size, source, preprocessing: [...]},
                      model: {name, parameters, trainable, frozen}}
    diagnostics:     {not_private: str, accuracy, baseline_accuracy, evaluated_on,
                      grad_norms: {...} | null}   — only with ``diagnostics=True``
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpfy.report.facts import RELEASES, UNITS, RunFacts, asdict, json_safe
from dpfy.report.pitfalls import Finding, Severity, find_pitfalls

REPORT_FORMAT = "dpfy.report.render"
REPORT_VERSION = 1
TUNING = "tuning"

SectionBuilder = Callable[[RunFacts, tuple[Finding, ...]], Any]
SectionRenderer = Callable[[Any], list[str]]


@dataclass(frozen=True)
class Section:
    """One report section: its JSON key, its Markdown heading, and how to build and render it."""

    key: str
    title: str
    build: SectionBuilder
    render: SectionRenderer
    diagnostic: bool = False


SECTIONS: dict[str, Section] = {}


def section(
    key: str, title: str, render: SectionRenderer, *, diagnostic: bool = False
) -> Callable[[SectionBuilder], SectionBuilder]:
    """Register a section builder; sections appear in registration order."""

    def register(build: SectionBuilder) -> SectionBuilder:
        SECTIONS[key] = Section(key, title, build, render, diagnostic)
        return build

    return register


# -- formatting helpers ---------------------------------------------------------------------------


def _eps(value: Any) -> str:
    """An ε for people: 4 significant digits, ∞ when unbounded, — when absent."""
    if value is None:
        return "—"
    value = float(value)
    if math.isinf(value):
        return "∞"
    return f"{value:.4g}"


def _num(value: Any) -> str:
    """A number or fact for a table cell."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _paragraph(data: dict[str, Any]) -> list[str]:
    """Render a section that is one statement."""
    return [data["statement"]]


# -- §5.3.3 items 1–4 -----------------------------------------------------------------------------


@section("dp_setting", "1. DP setting", _paragraph)
def _dp_setting(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """Central DP with a trusted curator: dpfy's trainer sees the raw data (guide §3.1)."""
    algorithm = _ALGORITHMS.get(facts.privacy.algorithm, facts.privacy.algorithm)
    statement = (
        "Central differential privacy with a trusted curator: the training process sees the "
        "raw private data, and only its outputs are protected. Protection covers features "
        f"and labels (full-training DP via {algorithm}, guide §3.1–§3.2)."
    )
    federated = _FEDERATED.get(facts.privacy.algorithm)
    if federated is not None:  # dpfy.federated: the server is the trusted curator
        statement = (
            "Central differential privacy with a trusted aggregator: the server sees each "
            "sampled user's model change in the clear, and only the noised global models are "
            f"protected. Protection covers features and labels (full-training DP via {federated},"
            " guide §3.1–§3.2, §4.4)."
        )
    ranks = facts.privacy.world_size
    if ranks > 1:  # dpfy.train.distributed: the ranks and their all-reduce are the trusted curator
        statement += (
            f" Training ran in {ranks} processes (torch.distributed): each Poisson-sampled its "
            "shard of the data at the same q and added an independent noise share, the shares "
            "summing to one N(0, σ²C²) on the all-reduced sum; the processes and the channel "
            "between them are trusted. Diagnostics below cover rank 0's shard only."
        )
    return {"model": "central", "curator": "trusted", "statement": statement}


_FEDERATED = {"dp-fedavg": "DP-FedAvg", "dp-fedsgd": "DP-FedSGD"}
_CLIPPED_SUMS = dict.fromkeys(_FEDERATED, "user model changes")  # what the noise is added to
_ALGORITHMS = {"dp-sgd": "DP-SGD", "dp-ftrl": "DP-FTRL (Kairouz et al. 2021)", **_FEDERATED}


@section("released", "2. What is released", _paragraph)
def _released(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """What leaves the curator; everything computed from DP outputs is post-processing (§2.2)."""
    outputs = facts.training.released
    federated = facts.privacy.algorithm in _FEDERATED  # rounds of noised averages of changes
    noised = (
        "the noised averages of clipped user model changes" if federated else "the noised gradients"
    )
    steps = "noised rounds" if federated else "noised gradient steps"
    statement = (
        f"Released: {RELEASES[outputs]}. Released models are computed only from their "
        f"public initialisation and {noised}, so they are post-processing of the DP outputs and "
        "carry the same guarantee (guide §2.2); the ε below covers all "
        f"{facts.training.steps_taken} {steps}."
    )
    return {"outputs": outputs, "statement": statement}


@section("unit_of_privacy", "3. Unit of privacy", _paragraph)
def _unit(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """Which record the guarantee protects (guide §2.1)."""
    unit = facts.training.unit
    statement = f"Unit of privacy: {UNITS[unit]} (guide §2.1)."
    data: dict[str, Any] = {"unit": unit, "statement": statement}
    p = facts.privacy
    if p.unit == "user":
        cap = p.max_examples_per_user
        data.update(users=p.dataset_size, examples=p.examples, max_examples_per_user=cap)
        data["statement"] += (
            f" {p.dataset_size} users hold the {p.examples} training examples; each step samples "
            f"users (not examples) with probability q = {p.sampling_rate:.6g}, and each sampled "
            "user's gradient is the mean over "
            + ("all of their examples" if cap is None else f"at most {cap} of their examples "
               "(drawn uniformly each time the user is sampled)")
            + ", clipped to C as one unit (user-level DP-SGD, McMahan et al. 2018)."
        )  # fmt: skip
    if p.unit == "user" and p.algorithm != "dp-sgd":  # dpfy.federated: DP-FedAvg / DP-FedSGD
        data["statement"] = statement + (
            f" {p.dataset_size} users hold the {p.examples} training examples; each round samples "
            f"users with probability q = {p.sampling_rate:.6g}, each sampled user trains locally "
            "on their own examples, and their whole model change is clipped to C as one unit "
            f"({_FEDERATED.get(p.algorithm, p.algorithm)}, guide alg. 2, McMahan et al. 2018)."
        )
    return data


_RELATIONS = {
    "add-or-remove": "neighbouring datasets differ by adding or removing one record",
    "zero-out": "neighbouring datasets differ by replacing one record with a null record",
    "replace-one": (
        "neighbouring datasets differ by replacing one record with another (this doubles the "
        "sensitivity of a sum of clipped gradients)"
    ),
}


def _render_relation(data: dict[str, Any]) -> list[str]:
    """The relation and the comparability warning."""
    return [data["statement"], "", data["comparability"]]


@section("neighbouring_relation", "4. Neighbouring relation", _render_relation)
def _relation(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """Adjacency from the ledger, which refuses to mix relations (DESIGN rule 7)."""
    relation = facts.accounting.summary["relation"]
    meaning = _RELATIONS[relation]
    if facts.privacy.unit == "user":  # the record is a user with all of their examples
        meaning = meaning.replace("one record", "one user (all of that user's examples)")
    return {
        "relation": relation,
        "statement": f"Neighbouring relation: {relation} — {meaning}.",
        "comparability": (
            "ε under different neighbouring relations is not comparable: replace-one roughly "
            "doubles the sensitivity of add-or-remove (guide §2.1)."
        ),
    }


# -- §5.3.3 items 5–6: accounting and its assumptions ---------------------------------------------


def _render_accounting(data: dict[str, Any]) -> list[str]:
    """A statement and the accountant's parameters as a list."""
    lines = [data["statement"], ""]
    keys = [
        ("accountant", "accountant"),
        ("delta", "δ"),
        ("sampling_rate", _rate_label(data["sampler"])),
        ("noise_multiplier", "σ (noise multiplier)"),
        ("max_grad_norm", "C (clip norm)"),
        ("sensitivity", "sensitivity"),
        ("noise_std", "noise std on the clipped sum"),
        ("steps", "steps accounted"),
        ("planned_steps", "steps planned"),
        ("expected_batch_size", "expected batch size B = qN"),
        ("dataset_size", "N"),
        ("sampler", "sampler"),
    ]
    lines += [f"- {label}: {_num(data[key])}" for key, label in keys]
    lines.append(f"- sampling as recorded: {data['sampler_description']}")
    return lines


def _rate_label(sampler: str) -> str:
    """B/N is a sampling rate q, except for DP-FTRL, which samples nothing."""
    return (
        "B/N (batch fraction; nothing is sampled)"
        if sampler in _TREE_SAMPLERS
        else ("q (sampling rate)")
    )


@section("accounting", "5. Accounting method and parameters", _render_accounting)
def _accounting(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """The accountant and every parameter it was given (guide §4.2, §5.3.3)."""
    p, summary = facts.privacy, facts.accounting.summary
    names = {"pld": "privacy-loss distribution (PLD)", "rdp": "Rényi DP (RDP)"}
    accountant = summary["accountant"]
    descriptions = sorted({s["description"] for s in summary["sampling"]}) or [
        "no training step was recorded"
    ]
    factor = p.sensitivity_factor
    return {
        "accountant": accountant,
        "delta": summary["delta"],
        "sampling_rate": p.sampling_rate,
        "noise_multiplier": p.noise_multiplier,
        "max_grad_norm": p.max_grad_norm,
        "steps": summary["steps"],
        "planned_steps": p.steps,
        "expected_batch_size": p.expected_batch_size,
        "dataset_size": p.dataset_size,
        "sampler": p.sampler,
        "sampler_description": " ".join(descriptions),
        "sensitivity": factor * p.max_grad_norm,
        "noise_std": p.noise_multiplier * factor * p.max_grad_norm,
        "statement": _tree_statement(p, names.get(accountant, accountant))
        if p.sampler in _TREE_SAMPLERS
        else (
            f"Accounted with the {names.get(accountant, accountant)} accountant over every "
            f"recorded step: each step is the subsampled Gaussian mechanism with noise multiplier "
            f"σ = {p.noise_multiplier:.6g} (noise std σ·sensitivity on the sum of clipped "
            f"{_CLIPPED_SUMS.get(p.algorithm, 'gradients')}, decoupled from C, guide §4.2) at "
            "sampling rate q = "
            f"{p.sampling_rate:.6g}."
        ),
    }


def _tree_statement(p: Any, accountant: str) -> str:
    """How a DP-FTRL run is accounted (Kairouz et al. 2021, App. D; dpfy.plan.tree_events)."""
    return (
        f"DP-FTRL with tree aggregation, accounted with the {accountant} accountant and NO "
        "sampling assumption: every node of the binary tree over the steps carries Gaussian "
        f"noise of std σ·sensitivity (σ = {p.noise_multiplier:.6g}); one example's clipped "
        "gradient sits in at most ⌈log₂(T+1)⌉ nodes of a tree of T steps and enters each tree at "
        "most once, so each epoch is a Gaussian mechanism of noise σ/√⌈log₂(T+1)⌉ and epochs "
        "compose. Adjacency replaces an example by a null one (the order is kept)."
    )


_TREE_NO_SAMPLING = (
    True,
    "Met — no sampling assumption was used: batches of B = {batch} were taken in {order} order, "
    "each example at most once per epoch, and DP-FTRL's tree aggregation is accounted for any "
    "such order (Kairouz et al. 2021).",
)
_TREE_SAMPLERS = {"tree-shuffle": "a shuffled", "tree-fixed-order": "a fixed"}

_SAMPLING = {
    "poisson": (
        True,
        "Met: every example joined each batch independently with probability q (Poisson "
        "sampling), as the accountant assumes.",
    ),
    "shuffle": (
        False,
        "NOT met: batches were shuffled fixed-size batches (one pass per epoch), but ε is "
        "computed as if they were Poisson-sampled at q = B/N. ε under the Poisson assumption = "
        "{eps}; the honest ε for shuffled batches is not known (guide §4.3).",
    ),
    "fixed-size": (
        True,
        "Met: batches of a fixed size drawn uniformly at every step, accounted honestly as "
        "fixed-size subsampling under replace-one adjacency (not as Poisson).",
    ),
    "tree-shuffle": _TREE_NO_SAMPLING,
    "tree-fixed-order": _TREE_NO_SAMPLING,
}


def _per_user(template: str) -> str:
    """A sampling statement about examples, said of users (user-level runs sample users)."""
    return template.replace("every example joined each batch", "every user joined each step")


def _render_assumptions(data: dict[str, Any]) -> list[str]:
    """One bullet per assumption."""
    verdict = "all met" if data["all_met"] else "NOT all met"
    return [
        f"Accounting assumptions: **{verdict}**.",
        "",
        f"- Sampling ({data['sampling']['kind']}): {data['sampling']['statement']}",
        f"- Noise on every trainable parameter at every step: "
        f"{data['noise_on_every_trainable_parameter']['statement']}",
        f"- Frozen parameters: {data['frozen_parameters']['statement']}",
        f"- Clipping: {data['clipping']['statement']}",
    ]


@section("assumptions", "6. Did the accounting assumptions hold?", _render_assumptions)
def _assumptions(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """Sampling, noise coverage, frozen parameters and clipping sensitivity (§4.3, alg. 3)."""
    kind = facts.privacy.sampler
    met, template = _SAMPLING[kind]
    model = facts.model
    unnoised = model.unnoised_trainable_names
    noised_values = model.trainable
    noise_statement = (
        f"yes — dpfy adds Gaussian noise to every coordinate of all {noised_values:,} trainable "
        "values at every step, including coordinates whose gradient is zero (DESIGN rule 2)."
        if not unnoised
        else f"NO — trainable tensors outside the private optimizer: {', '.join(unnoised)}."
    )
    frozen_statement = (
        f"{len(model.frozen_names)} tensor(s), {model.frozen:,} values, not trained: "
        f"{', '.join(model.frozen_names)}. They are released as initialised and must come from "
        "public data or random initialisation."
        if model.frozen_names
        else "none; every parameter was trained with DP."
    )
    k = facts.privacy.microbatch_size
    clipping = (
        f"per-example clipping to C, sensitivity C = {facts.privacy.max_grad_norm:g}."
        if k is None
        else f"microbatches of {k} examples, the average gradient of each clipped to C: "
        f"sensitivity 2C = {2 * facts.privacy.max_grad_norm:g}, noise std 2σC (guide alg. 3)."
    )
    if facts.privacy.unit == "user":
        clipping = (
            "per-user clipping: each sampled user's mean gradient is clipped to C, so adding or "
            f"removing one user moves the sum by at most C = {facts.privacy.max_grad_norm:g}."
        )
        if facts.privacy.algorithm != "dp-sgd":
            clipping = clipping.replace("mean gradient", "model change after local training")
    return {
        "all_met": bool(facts.accounting.summary["assumptions_met"]) and met and not unnoised,
        "sampling": {
            "kind": kind,
            "poisson": kind == "poisson",
            "met": met,
            "statement": (template if facts.privacy.unit != "user" else _per_user(template)).format(
                eps=_eps(facts.accounting.epsilon_under_poisson_assumption),
                batch=facts.privacy.expected_batch_size,
                order=_TREE_SAMPLERS.get(kind, ""),
            ),
        },
        "noise_on_every_trainable_parameter": {
            "met": not unnoised,
            "noised_values": noised_values,
            "statement": noise_statement,
        },
        "frozen_parameters": {
            "tensors": len(model.frozen_names),
            "values": model.frozen,
            "names": list(model.frozen_names),
            "statement": frozen_statement,
        },
        "clipping": {
            "unit": facts.privacy.unit if k is None else "microbatch",
            "microbatch_size": k,
            "sensitivity_in_c": facts.privacy.sensitivity_factor,
            "statement": clipping,
        },
    }


# -- §5.3.3 item 7: (ε, δ) for training, tuning and their total -----------------------------------


def _tuning_statement(facts: RunFacts, epsilons: dict[str, float], events: dict[str, int]) -> str:
    """What the tuning line says: accounted ε, public tuning, none, or unaccounted tuning."""
    if TUNING in epsilons:
        return (
            f"ε_tuning = {_eps(epsilons[TUNING])} from {events.get(TUNING, 0)} tuning event(s) "
            "recorded in the ledger (guide §5.4.2)."
        )
    tuning = facts.tuning
    if tuning.data == "public":
        return "none on private data: tuning on public data (declared by the trainer)."
    if tuning.data == "private" and tuning.trials:
        return (
            f"NOT ACCOUNTED: {tuning.trials} tuning trial(s) ran on the private data but no "
            "tuning event is in the ledger; the total below understates the privacy cost."
        )
    return "none: no tuning on private data."


def _render_epsilon(data: dict[str, Any]) -> list[str]:
    """Training, tuning, other and total ε, with the assumption under which they hold."""
    delta = data["delta"]
    caveat = "" if data["assumptions_met"] else " (under the Poisson assumption, NOT met)"
    lines = [data["statement"], ""]
    lines.append(f"- training: ε = {_eps(data['training'])} at δ = {delta:g}{caveat}")
    lines.append(f"- tuning: {data['tuning_statement']}")
    for label, value in data["other"].items():
        lines.append(f"- {label}: ε = {_eps(value)} at δ = {delta:g}")
    lines.append(
        f"- **total: ε = {_eps(data['total'])} at δ = {delta:g}** ({data['accountant']}){caveat}"
    )
    if data["under_poisson_assumption"] is not None:  # None: DP-FTRL assumes no sampling
        lines.append(
            f"- ε under the Poisson-sampling assumption: {_eps(data['under_poisson_assumption'])}"
        )
        proven = data["proven_total"]
        lines.append(
            "- ε proven for the sampling actually used: "
            + (_eps(proven) if proven is not None else "not known (shuffled batches, guide §4.3)")
        )
    if data["target_epsilon"] is not None:
        target = data["target_epsilon"]
        line = f"- target ε (budget guard): {_eps(target)}"
        if data["total"] > target:  # only events recorded after training can take it past
            line += (
                " — the guard covered every event recorded while training ran; events recorded "
                "after training (e.g. the tuning above) add to the total"
            )
        lines.append(line)
    return lines


@section("epsilon", "7. Privacy budget (ε, δ)", _render_epsilon)
def _epsilon(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """ε per ledger label at the run's δ; honest about which ε is proven (guide §4.3, §5.4.2)."""
    summary = facts.accounting.summary
    epsilons: dict[str, float] = dict(summary["epsilon"])
    events: dict[str, int] = dict(summary.get("labelled_events") or {})
    met = bool(summary["assumptions_met"])
    total = epsilons["total"]
    other = {k: v for k, v in epsilons.items() if k not in ("training", TUNING, "total")}
    if met:
        statement = (
            f"The run satisfies ({_eps(total)}, {summary['delta']:g})-DP in total, training and "
            "every recorded tuning or other release composed."
        )
    else:
        statement = (
            f"ε = {_eps(total)} at δ = {summary['delta']:g} holds only under the Poisson-sampling "
            "assumption, which this run did NOT meet; no ε is proven for its shuffled batches."
        )
    return {
        "delta": summary["delta"],
        "accountant": summary["accountant"],
        "training": epsilons.get("training"),
        "tuning": epsilons.get(TUNING),
        "tuning_statement": _tuning_statement(facts, epsilons, events),
        "other": other,
        "total": total,
        "target_epsilon": summary["target_epsilon"],
        "assumptions_met": met,
        "under_poisson_assumption": None
        if facts.privacy.sampler in _TREE_SAMPLERS
        else facts.accounting.epsilon_under_poisson_assumption,
        "proven_total": total if met else None,
        "statement": statement,
    }


def _render_table(data: dict[str, Any]) -> list[str]:
    """ε at several δ under PLD and RDP, as a Markdown table."""
    lines = [data["statement"], "", "| δ | ε (PLD) | ε (RDP) |", "|---|---|---|"]
    lines += [f"| {r['delta']:g} | {_eps(r['pld'])} | {_eps(r['rdp'])} |" for r in data["rows"]]
    lines += [f"\nNote: {note}" for note in data["notes"]]
    return lines


@section("epsilon_table", "ε at other δ, PLD beside RDP", _render_table)
def _epsilon_table(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """Total ε at a few standard δ under both accountants, for comparison with other work."""
    assumption = (
        "" if facts.accounting.summary["assumptions_met"] else " (under the Poisson assumption)"
    )
    return {
        "rows": [asdict(row) for row in facts.accounting.epsilon_table],
        "notes": list(facts.accounting.notes),
        "statement": (
            f"Total ε{assumption} at several δ. PLD is tight; RDP is a looser upper bound, shown "
            "for comparison with work that reports it (guide §4.2.2)."
        ),
    }


# -- §5.3.3 items 8–9 -----------------------------------------------------------------------------

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
    """A table: name, symbol, value."""
    lines = ["| hyperparameter | symbol | value |", "|---|---|---|"]
    rows = _HYPERPARAMETERS + (_USER_HYPERPARAMETERS if data.get("unit") == "user" else ())
    labels = _USER_LABELS if data.get("unit") == "user" else {}
    lines += [
        f"| {labels.get(key, label)} | {sym} | {_num(data[key])} |" for key, sym, label in rows
    ]
    return lines


# User-level runs (dpfy.train.user_level): N and B count users, and two more rows say what a user
# is.
_USER_HYPERPARAMETERS = (
    ("examples", "", "training examples held by the users"),
    ("max_examples_per_user", "", "max examples per sampled user (— = all)"),
)
_USER_LABELS = {
    "dataset_size": "users",
    "sampling_rate": "user sampling rate B/N",
    "expected_batch_size": "expected users per step",
}


@section("hyperparameters", "8. Hyperparameters", _render_hyperparameters)
def _hyperparameters(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """N, q, B, σ, C, steps, epochs, optimizer and learning rate (guide §5.4.1)."""
    p, t = facts.privacy, facts.training
    return {
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
    } | (
        {"unit": "user", "examples": p.examples, "max_examples_per_user": p.max_examples_per_user}
        if p.unit == "user"
        else {}
    )


def _render_software(data: dict[str, str]) -> list[str]:
    """One bullet per package."""
    return [f"- {name} {version}" for name, version in data.items()]


@section("software", "9. Software", _render_software)
def _software(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, str]:
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
def _pitfalls(facts: RunFacts, findings: tuple[Finding, ...]) -> list[dict[str, str]]:
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
        lines.append(f"- Preprocessing: {step['name']} ({origin}) {step['description']}".rstrip())
    return lines


@section("run", "Run", _render_run)
def _run(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
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
    lines.append(f"- accuracy of the private model{on}: {_num(data['accuracy'])}")
    lines.append(f"- accuracy of the non-private baseline{on}: {_num(data['baseline_accuracy'])}")
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
def _diagnostics(facts: RunFacts, findings: tuple[Finding, ...]) -> dict[str, Any]:
    """Accuracy and gradient-norm statistics for the engineer, marked as not private."""
    r = facts.results
    return {
        "not_private": _NOT_PRIVATE,
        "accuracy": r.accuracy,
        "baseline_accuracy": r.baseline_accuracy,
        "evaluated_on": r.evaluated_on,
        "grad_norms": None if facts.grad_norms is None else asdict(facts.grad_norms),
        "clipped": _CLIPPED.get(
            (facts.privacy.unit, facts.privacy.algorithm),
            "per-example gradient"
            if facts.privacy.microbatch_size is None
            else "per-microbatch gradient",
        ),
    }


# What one clipped vector is, by (unit, algorithm), for the diagnostics line.
_CLIPPED = {
    ("user", "dp-sgd"): "per-user gradient",
    ("user", "dp-fedavg"): "per-user model-change",
    ("user", "dp-fedsgd"): "per-user model-change",
}


# -- the card -------------------------------------------------------------------------------------


def _headline(facts: RunFacts, findings: tuple[Finding, ...]) -> str:
    """One paragraph: the claim, the assumption it rests on, and how many errors undermine it."""
    summary = facts.accounting.summary
    eps, delta = _eps(summary["epsilon"]["total"]), summary["delta"]
    unit = facts.training.unit
    released = RELEASES[facts.training.released]
    if summary["assumptions_met"]:
        text = (
            f"{facts.model.name} trained on {facts.dataset.name}, releasing {released}, "
            f"satisfies ({eps}, {delta:g})-DP at the {unit} level under {summary['relation']} "
            f"adjacency ({summary['accountant'].upper()} accounting of training and every "
            "recorded tuning run)."
        )
    else:
        text = (
            f"{facts.model.name} trained on {facts.dataset.name}: ε = {eps} at δ = {delta:g} "
            "is computed under a Poisson-sampling assumption this run did NOT meet (its batches "
            "were shuffled); no ε is proven for the sampling actually used."
        )
    errors = sum(f.severity is Severity.ERROR for f in findings)
    if errors:
        text += f" {errors} error-level pitfall(s) below weaken or void this claim."
    return text


@dataclass(frozen=True)
class ReportCard:
    """The report: a headline and one JSON-ready section per §5.3.3 item, plus pitfalls."""

    title: str
    headline: str
    sections: dict[str, Any]
    findings: tuple[Finding, ...]

    def to_json(self, *, diagnostics: bool = True) -> dict[str, Any]:
        """The stable JSON form (schema in the module docstring)."""
        body = {
            key: value
            for key, value in self.sections.items()
            if diagnostics or not SECTIONS[key].diagnostic
        }
        return json_safe(
            {
                "format": REPORT_FORMAT,
                "version": REPORT_VERSION,
                "title": self.title,
                "headline": self.headline,
                **body,
            }
        )

    def to_markdown(self, *, diagnostics: bool = True) -> str:
        """A human-readable report; ``diagnostics=False`` leaves out the non-private figures."""
        lines = [f"# {self.title}", "", self.headline]
        for key, value in self.sections.items():
            spec = SECTIONS[key]
            if spec.diagnostic and not diagnostics:
                continue
            lines += ["", f"## {spec.title}", "", *spec.render(value)]
        return "\n".join(lines) + "\n"


def build_report(facts: RunFacts) -> ReportCard:
    """The report card of a run, derived entirely from its facts and the pitfall detectors."""
    findings = find_pitfalls(facts)
    return ReportCard(
        title=f"Privacy report: {facts.model.name} on {facts.dataset.name}",
        headline=_headline(facts, findings),
        sections={key: spec.build(facts, findings) for key, spec in SECTIONS.items()},
        findings=findings,
    )


# -- run directories ------------------------------------------------------------------------------

FACTS_FILE = "facts.json"
REPORT_MARKDOWN = "report.md"
REPORT_JSON = "report.json"
EPSILON_PLOT = "epsilon.png"
TRAINING_PLOT = "training.png"

FORMATS: dict[str, Callable[[ReportCard], str]] = {
    "md": lambda card: card.to_markdown(),
    "json": lambda card: (
        json.dumps(card.to_json(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    ),
}


def render(facts: RunFacts, fmt: str = "md") -> str:
    """The report of ``facts`` as Markdown ('md') or indented JSON ('json') text."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    return FORMATS[fmt](build_report(facts))


def render_run(run_dir: str | os.PathLike[str], fmt: str = "md") -> str:
    """Re-render the report of a saved run from its facts file (what ``dpfy report`` prints).

    A re-rendered report recomputes ε from the stored events and never trusts a stored number:
    :meth:`RunFacts.load` rebuilds the ledger and refuses, with one ValueError naming the file,
    the field and the fix, any file whose figures the recomputation does not bear out.
    """
    return render(RunFacts.load(Path(run_dir) / FACTS_FILE), fmt)


def write_report(
    facts: RunFacts,
    run_dir: str | os.PathLike[str],
    *,
    history: Sequence[Mapping[str, Any]] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write the facts, report.md, report.json and the PNG plots into ``run_dir``.

    Returns the written paths by name. The training plot needs the trainer's ``history``.
    """
    target = Path(run_dir)
    target.mkdir(parents=True, exist_ok=True)
    written = {"facts": facts.save(target / FACTS_FILE)}
    for name, (fmt, filename) in {
        "markdown": ("md", REPORT_MARKDOWN),
        "json": ("json", REPORT_JSON),
    }.items():
        written[name] = target / filename
        written[name].write_text(render(facts, fmt), encoding="utf-8")
    if plots:
        from dpfy.report.plots import plot_epsilon_curve, plot_training_curves

        if facts.accounting.summary["steps"]:
            written["epsilon_plot"] = target / EPSILON_PLOT
            plot_epsilon_curve(facts, written["epsilon_plot"])
        if history:
            written["training_plot"] = target / TRAINING_PLOT
            plot_training_curves(history, written["training_plot"])
    return written


__all__ = [
    "EPSILON_PLOT",
    "FACTS_FILE",
    "FORMATS",
    "REPORT_FORMAT",
    "REPORT_JSON",
    "REPORT_MARKDOWN",
    "REPORT_VERSION",
    "SECTIONS",
    "TRAINING_PLOT",
    "ReportCard",
    "Section",
    "build_report",
    "render",
    "render_run",
    "section",
    "write_report",
]
