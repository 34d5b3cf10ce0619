"""The privacy report card: a headline and every item of the guide's §5.3.3 list, from the facts.

:func:`build_report` turns :class:`~dpfy.report.facts.RunFacts` into a :class:`ReportCard`;
nothing in it is typed by hand. The run's wording is looked up once from its privacy plan, each
section is built by one declared function, and the Markdown is rendered from the same JSON the
card exports, so the two never disagree.

The card is what a user publishes, so it holds only what the mechanism released and public facts
(released facts only): the plan and hyperparameters, the ledger's ε, the model's counts, declared
facts (dataset name and size, preprocessing, what is released), the software, the released
model's held-out test accuracy and the pitfalls found from those. Un-noised statistics of the
private data — per-example gradient norms, a non-private baseline, the checks that read them —
are :mod:`dpfy.report.diagnostics`'s, in a file marked not for publication; the card says that
file exists, never what it holds.

JSON schema (``ReportCard.to_json()``; keys are stable, version 2; ε values are numbers, or the
strings "inf"/"nan" when unbounded, or null where not applicable)::

    format: "dpfy.report.render", version: 2
    title: str                                      "Privacy report: MODEL on DATASET"
    headline: str                                   one-paragraph claim, honest about assumptions
    dp_setting:      {model: "central", curator: "trusted", statement}                   §3.1
    released:        {outputs: "final-model" | "every-checkpoint", public: [str],
                      statement}                                                         §2.2
    unit_of_privacy: {unit: "example" | "user", statement,
                      users, examples, max_examples_per_user (user-level runs only)}     §2.1
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
                      lower_bound (proven ε floor for once-per-epoch batches, else
                      null), statement}                                                  §5.4.2
    epsilon_table:   {rows: [{delta, pld, rdp}], notes: [str], statement}
    empirical_audit: {audits: [{method, threat_model, epsilon_lower_bound, confidence, delta,
                      claimed_epsilon, canaries, runs, guesses, correct, seconds, notes,
                      method_description, threat_model_description, exceeds_claim,
                      statement}], any_exceeds_claim, statement}
    behaviour_checks: {checks: {collate|model|loss|state: {status, probes, detail,
                      schedule}} | null, verifies, gaps: [str], lines: [str], statement}
                      (what the run's own code was observed to do)                    §5.5.1
    hyperparameters: {dataset_size, sampling_rate, expected_batch_size, noise_multiplier,
                      max_grad_norm, steps, epochs, optimizer, learning_rate,
                      microbatch_size, loss_reduction, sampler,
                      unit, examples, max_examples_per_user (user-level runs only)}      §5.4.1
    software:        {python, dpfy, "dpfy commit", torch, numpy, scipy, matplotlib}     §5.3.3
    pitfalls:        [{code, severity, title, evidence, fix, guide_section}]  (detectors
                      that read released or public facts only)                           §5.4–5.5
    run:             {dataset: {name, size, source, preprocessing: [...]},
                      model: {name, parameters, trainable, frozen}}
    results:         {accuracy, evaluated_on, statement, diagnostics}  (the released model's
                      held-out accuracy; ``diagnostics`` names the diagnostics file)

Version 2 moved version 1's ``diagnostics`` section (gradient-norm statistics, the non-private
baseline's accuracy) off the card into the diagnostics file, and added ``results``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpfy.report import (
    accounting_sections,
    audit_sections,
    behaviour_sections,
    run_sections,
    setting_sections,
)
from dpfy.report.facts import RunFacts
from dpfy.report.json_codec import json_safe
from dpfy.report.pitfalls import Finding, Severity, find_pitfalls
from dpfy.report.run_parts import RELEASES
from dpfy.report.sections import Section, show_epsilon
from dpfy.report.wording import wording_for

REPORT_FORMAT = "dpfy.report.render"
REPORT_VERSION = 2

#: Sections rendered as a subsection of the numbered section before them (Markdown ``###``):
#: the ε table belongs to §7, the privacy budget.
SUBSECTIONS = frozenset({"epsilon_table"})


def _numbered(spec: Section) -> bool:
    """Whether the section is an item of the guide's §5.3.3 list ("7. Privacy budget …")."""
    return spec.title.split(".", 1)[0].isdigit()


def _in_reading_order(specs: tuple[Section, ...]) -> dict[str, Section]:
    """The §5.3.3 items 1, 2, … without a gap (each with its subsections), then every other
    section in its own order: no unnumbered section falls between two numbered ones."""
    ordered: list[Section] = []
    others: list[Section] = []
    for spec in specs:
        if _numbered(spec) or (spec.key in SUBSECTIONS and ordered and _numbered(ordered[-1])):
            ordered.append(spec)
        else:
            others.append(spec)
    return {spec.key: spec for spec in (*ordered, *others)}


#: Every section in the order of the guide's §5.3.3 list, then the audit, the behaviour checks,
#: pitfalls, the run and its results.
SECTIONS: dict[str, Section] = _in_reading_order(
    (
        *setting_sections.SECTIONS,
        *accounting_sections.SECTIONS,
        *audit_sections.SECTIONS,
        *behaviour_sections.SECTIONS,
        *run_sections.SECTIONS,
    )
)


def _headline(facts: RunFacts, findings: tuple[Finding, ...]) -> str:
    """One paragraph: the claim, the assumption it rests on, and how many errors undermine it.

    Whether the claim holds, and if not why, is the ledger's sampling records' own word.
    """
    summary = facts.accounting.summary
    eps, delta = show_epsilon(summary.total_epsilon), summary.delta
    unmet = [s.sampling for s in summary.sampling if not s.sampling.assumption_met]
    if not unmet:
        text = (
            f"{facts.model.name} trained on {facts.dataset.name}, releasing "
            f"{RELEASES[facts.training.released]}, satisfies ({eps}, {delta:g})-DP at the "
            f"{facts.training.unit} level under {summary.relation} adjacency "
            f"({summary.accountant.upper()} accounting of training and every recorded tuning "
            "run)."
        )
    else:
        text = (
            f"{facts.model.name} trained on {facts.dataset.name}: ε = {eps} at δ = {delta:g} "
            f"rests on a sampling assumption this run did NOT meet. {unmet[0].description} No ε "
            "is proven for the sampling actually used."
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

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form (schema in the module docstring)."""
        return json_safe(
            {
                "format": REPORT_FORMAT,
                "version": REPORT_VERSION,
                "title": self.title,
                "headline": self.headline,
                **self.sections,
            }
        )

    def to_markdown(self) -> str:
        """A human-readable report, rendered from the same data as :meth:`to_json`."""
        lines = [f"# {self.title}", "", self.headline]
        for key, value in self.sections.items():
            spec = SECTIONS[key]
            level = "###" if key in SUBSECTIONS else "##"
            lines += ["", f"{level} {spec.title}", "", *spec.render(value)]
        return "\n".join(lines) + "\n"


def build_report(facts: RunFacts) -> ReportCard:
    """The report card of a run, derived entirely from its facts and the pitfall detectors.

    Only the detectors that read released or public facts run: a finding drawn from un-noised
    statistics of the private data would carry them onto the card.
    """
    findings = find_pitfalls(facts, diagnostics=False)
    words = wording_for(facts.privacy)
    return ReportCard(
        title=f"Privacy report: {facts.model.name} on {facts.dataset.name}",
        headline=_headline(facts, findings),
        sections={key: spec.build(facts, findings, words) for key, spec in SECTIONS.items()},
        findings=findings,
    )


__all__ = ["REPORT_FORMAT", "REPORT_VERSION", "SECTIONS", "ReportCard", "build_report"]
