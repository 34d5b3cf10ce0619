"""Report items 5–7 (guide §5.3.3): the accounting, whether its assumptions held, and (ε, δ).

Each figure is read from the facts' ledger summary and ε table; whether the sampling assumption
held is the sampling record's own verdict, and the sentences are the run's wording.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from dpfy.plan.accounting.truncation import truncation_probability
from dpfy.plan.sampling import SamplingKind
from dpfy.report.accounting import planned_sampling
from dpfy.report.sections import section, show_epsilon, show_value
from dpfy.report.wording import accounting_fields, sampler_wording

if TYPE_CHECKING:
    from dpfy.plan.privacy_plan import PrivacyPlan
    from dpfy.report.facts import RunFacts
    from dpfy.report.pitfalls import Finding
    from dpfy.report.wording import Wording

TUNING = "tuning"
_ACCOUNTANTS = {"pld": "privacy-loss distribution (PLD)", "rdp": "Rényi DP (RDP)"}
#: What a known ledger label other than training and tuning is, said beside its ε.
OTHER_RELEASES = {
    "untuned-default": (
        "a second model, the untuned default configuration, trained on the same private data "
        "for comparison (dpfy tune --compare-default)"
    ),
}


def _render_accounting(data: dict[str, Any]) -> list[str]:
    """A statement and the accountant's parameters as a list."""
    lines = [data["statement"], ""]
    keys = [
        ("accountant", "accountant"),
        ("delta", "δ"),
        ("sampling_rate", sampler_wording(data["sampler"]).rate_label),
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
    lines += [f"- {label}: {show_value(data[key])}" for key, label in keys]
    lines.append(f"- sampling as recorded: {data['sampler_description']}")
    return lines


@section("accounting", "5. Accounting method and parameters", _render_accounting)
def accounting(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """The accountant and every parameter it was given (guide §4.2, §5.3.3)."""
    p, summary = facts.privacy, facts.accounting.summary
    accountant = summary.accountant
    descriptions = sorted({s.description for s in summary.sampling}) or [
        "no training step was recorded"
    ]
    return {
        "accountant": accountant,
        "delta": summary.delta,
        "sampling_rate": p.sampling_rate,
        "noise_multiplier": p.noise_multiplier,
        "max_grad_norm": p.max_grad_norm,
        "steps": summary.steps,
        "planned_steps": p.steps,
        "expected_batch_size": p.expected_batch_size,
        "dataset_size": p.dataset_size,
        "sampler": p.sampler,
        "sampler_description": " ".join(descriptions),
        "sensitivity": p.sensitivity,
        "noise_std": p.noise_std,
        "statement": words.algorithm.accounting.format(
            accountant=_ACCOUNTANTS.get(accountant, accountant),
            sigma=p.noise_multiplier,
            q=p.sampling_rate,
            **accounting_fields(p),
        ),
    }


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
def assumptions(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """Sampling, noise coverage, frozen parameters and clipping sensitivity (§4.3, alg. 3)."""
    p, model = facts.privacy, facts.model
    record = planned_sampling(p)
    met = record.assumption_met
    unnoised = model.unnoised_trainable_names
    noised_values = model.trainable
    noise_statement = (
        f"yes — dpfy adds Gaussian noise to every coordinate of all {noised_values:,} trainable "
        "values at every step, including coordinates whose gradient is zero."
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
    return {
        "all_met": facts.accounting.summary.assumptions_met and met and not unnoised,
        "sampling": {
            "kind": p.sampler,
            "poisson": record.kind is SamplingKind.POISSON,
            "met": met,
            "statement": words.sampler.assumption.format(
                joined=words.unit.joined,
                eps=show_epsilon(facts.accounting.epsilon_under_poisson_assumption),
                batch=p.expected_batch_size,
                **_truncation_fields(p),
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
            "unit": p.clipping_unit,
            "microbatch_size": p.microbatch_size,
            "sensitivity_in_c": p.sensitivity_factor,
            "statement": words.clipping(p),
        },
    }


def _truncation_fields(plan: PrivacyPlan) -> dict[str, Any]:
    """Truncated Poisson's cap M and the per-step chance of a cut, for its sentence."""
    cap = getattr(plan, "max_batch_size", None)
    if cap is None:
        return {}
    return {
        "max_batch": cap,
        "cut": truncation_probability(plan.dataset_size, plan.sampling_rate, cap),
    }


def _tuning_statement(facts: RunFacts, epsilons: dict[str, float], events: dict[str, int]) -> str:
    """What the tuning line says: accounted ε, public tuning, none, or unaccounted tuning."""
    if TUNING in epsilons:
        return (
            f"ε_tuning = {show_epsilon(epsilons[TUNING])} from {events.get(TUNING, 0)} tuning "
            "event(s) in the ledger (guide §5.4.2): the tuning trials ran before this training "
            "run, and their cost was added to its ledger once training ended."
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
    lines.append(f"- training: ε = {show_epsilon(data['training'])} at δ = {delta:g}{caveat}")
    lines.append(f"- tuning: {data['tuning_statement']}")
    for label, value in data["other"].items():
        what = f" — {OTHER_RELEASES[label]}" if label in OTHER_RELEASES else ""
        lines.append(f"- {label}: ε = {show_epsilon(value)} at δ = {delta:g}{what}")
    lines.append(
        f"- **total: ε = {show_epsilon(data['total'])} at δ = {delta:g}** ({data['accountant']})"
        f"{caveat}"
    )
    if data["under_poisson_assumption"] is not None:  # None: DP-FTRL assumes no sampling
        lines += _sampling_lines(data["under_poisson_assumption"], data["proven_total"])
    if data.get("lower_bound") is not None:
        lines.append(_LOWER_BOUND_LINE.format(eps=show_epsilon(data["lower_bound"]), delta=delta))
    if data["target_epsilon"] is not None:
        target = data["target_epsilon"]
        line = f"- target ε (budget guard): {show_epsilon(target)}"
        if data["total"] > target:  # only events outside the guarded training can take it past
            line += _beyond_guard(data)
        lines.append(line)
    return lines


_LOWER_BOUND_LINE = (
    "- ε proven to be at least {eps} at δ = {delta:g} for batches that hold each example once "
    "per epoch: a lower bound no accountant can go below (the example alone in one of an "
    "epoch's k batches, seen through the largest of their noisy sums; zero-out adjacency; "
    "Chua et al. 2024, Annamalai et al. 2026)"
)


def _sampling_lines(assumed: float, proven: float | None) -> list[str]:
    """ε under the Poisson assumption and ε proven for the sampling used: one line when equal."""
    if proven is not None and _same(assumed, proven):
        return [
            f"- ε under the Poisson-sampling assumption: {show_epsilon(assumed)}, which is also "
            "the ε proven for the sampling actually used"
        ]
    shown = (
        show_epsilon(proven)
        if proven is not None
        else "not known (shuffled batches, guide §4.3): only the lower bound below is proven"
    )
    return [
        f"- ε under the Poisson-sampling assumption: {show_epsilon(assumed)}",
        f"- ε proven for the sampling actually used: {shown}",
    ]


def _same(a: float, b: float) -> bool:
    """Equal ε (both unbounded counts as equal), up to float rounding between accountants."""
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _beyond_guard(data: dict[str, Any]) -> str:
    """Why the total passes the target, naming the events in the order they happened."""
    parts = []
    if data["tuning"] is not None:
        parts.append(
            "the tuning trials ran before this training run, and their cost (added to the ledger "
            "once training ended) comes on top of it"
        )
    if data["other"]:
        parts.append("the other releases above were recorded outside training and add to it")
    return " — the guard covered every training step; " + "; ".join(parts) if parts else ""


@section("epsilon", "7. Privacy budget (ε, δ)", _render_epsilon)
def epsilon(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """ε per ledger label at the run's δ; honest about which ε is proven (guide §4.3, §5.4.2)."""
    summary = facts.accounting.summary
    epsilons = dict(summary.epsilon)
    met = summary.assumptions_met
    total = summary.total_epsilon
    other = {k: v for k, v in epsilons.items() if k not in ("training", TUNING, "total")}
    if met:
        statement = (
            f"The run satisfies ({show_epsilon(total)}, {summary.delta:g})-DP in total, training "
            "and every recorded tuning or other release composed."
        )
    else:
        statement = (
            f"ε = {show_epsilon(total)} at δ = {summary.delta:g} holds only under the "
            "Poisson-sampling assumption, which this run did NOT meet; no upper bound on ε is "
            "proven for its shuffled batches, and their true ε can be several times the Poisson "
            'figure (up to 4× in the measurements of Annamalai et al., "To shuffle or not to '
            'shuffle", NDSS 2026). What is proven is the lower bound below.'
        )
    return {
        "delta": summary.delta,
        "accountant": summary.accountant,
        "training": epsilons.get("training"),
        "tuning": epsilons.get(TUNING),
        "tuning_statement": _tuning_statement(facts, epsilons, dict(summary.labelled_events)),
        "other": other,
        "total": total,
        "target_epsilon": summary.target_epsilon,
        "assumptions_met": met,
        "under_poisson_assumption": facts.accounting.epsilon_under_poisson_assumption
        if words.sampler.poisson_comparison
        else None,
        "proven_total": total if met else None,
        "lower_bound": facts.accounting.epsilon_lower_bound,
        "statement": statement,
    }


def _render_table(data: dict[str, Any]) -> list[str]:
    """ε at several δ under PLD and RDP, as a Markdown table."""
    lines = [data["statement"], "", "| δ | ε (PLD) | ε (RDP) |", "|---|---|---|"]
    lines += [
        f"| {r['delta']:g} | {show_epsilon(r['pld'])} | {show_epsilon(r['rdp'])} |"
        for r in data["rows"]
    ]
    lines += [f"\nNote: {note}" for note in data["notes"]]
    return lines


@section("epsilon_table", "ε at other δ, PLD beside RDP", _render_table)
def epsilon_table(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """Total ε at a few standard δ under both accountants, for comparison with other work."""
    assumption = (
        "" if facts.accounting.summary.assumptions_met else " (under the Poisson assumption)"
    )
    return {
        "rows": [asdict(row) for row in facts.accounting.epsilon_table],
        "notes": list(facts.accounting.notes),
        "statement": (
            f"Total ε{assumption} at several δ. PLD is tight; RDP is a looser upper bound, shown "
            "for comparison with work that reports it (guide §4.2.2)."
        ),
    }


SECTIONS = (accounting, assumptions, epsilon, epsilon_table)

__all__ = ["OTHER_RELEASES", "SECTIONS", "TUNING"]
