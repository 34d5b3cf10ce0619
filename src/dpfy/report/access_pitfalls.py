"""Pitfalls of the access models beyond full training: where the chosen model misleads (§3.2).

Label-only DP says nothing about features, so it is sound only where the features are public;
input-level DP needs a finite sensitivity, so unbounded features void it; a seeded randomiser can
be replayed. Each check reads :class:`~dpfy.report.access_facts.AccessFacts` and returns
:class:`~dpfy.report.pitfalls.Finding` s with the evidence and the fix.
"""

from __future__ import annotations

from dpfy.report.access_facts import AccessFacts
from dpfy.report.pitfalls import Finding, Severity

__all__ = ["access_findings"]


def _label_features_private(access: AccessFacts) -> list[Finding]:
    """Label DP while the features were never declared public: the features are unprotected."""
    if access.model != "label" or access.features_public:
        return []
    return [
        Finding(
            "label-dp-features-private",
            Severity.WARNING,
            "Label-only DP chosen while the features are not declared public",
            "label-only DP protects only the labels: neighbouring datasets differ in one label, "
            "and the features enter training unprotected. The dataset's features were not "
            "declared public, so whatever they reveal about a person is not covered by ε.",
            "use label-only DP only where the features are truly public (then pass "
            "--features-public, or features_public=True, to record it); otherwise train with "
            "full-training DP (--access full), which protects features and labels.",
            "§3.2",
        )
    ]


def _input_unbounded(access: AccessFacts) -> list[Finding]:
    """Input-level DP without public bounds has no finite sensitivity: no guarantee at all."""
    if access.model != "input" or access.bounds:
        return []
    return [
        Finding(
            "input-dp-unbounded",
            Severity.ERROR,
            "Input-level DP on unbounded features",
            "no public bound was given for the features, so one record can move the noisy "
            "release arbitrarily far and the local randomiser's ε does not hold.",
            "clip every feature to published bounds (constants from the dataset's documentation, "
            "never from the data) before randomising.",
            "§3.2",
        )
    ]


def _input_labels_raw(access: AccessFacts) -> list[Finding]:
    """Input-level DP on the features alone leaves the labels in the clear."""
    if access.model != "input" or access.labels_protected:
        return []
    return [
        Finding(
            "input-dp-labels-raw",
            Severity.WARNING,
            "Input-level DP left the labels unrandomised",
            "only the features went through the local randomiser; the labels were used as "
            "they are, so ε covers the features of each record and nothing about its label.",
            "give the labels a share of the record's ε (randomised response), or state that the "
            "labels are public.",
            "§3.2",
        )
    ]


def _seeded(access: AccessFacts) -> list[Finding]:
    """A chosen seed makes the randomiser replayable by anyone who knows it."""
    if access.model == "full" or not access.seeded:
        return []
    return [
        Finding(
            "seeded-randomness",
            Severity.ERROR,
            "The randomisation was drawn from a chosen seed",
            "the run was given --seed: anyone who learns the seed can regenerate the "
            "randomisation and undo it, so ε holds only while the seed stays secret.",
            "leave the seed unset for anything you release (randomness from OS entropy, the "
            "default); keep seeds for reproducible experiments.",
            "§4.2",
        )
    ]


def access_findings(access: AccessFacts) -> tuple[Finding, ...]:
    """Every access-model pitfall of the run, errors first."""
    found = [
        *_label_features_private(access),
        *_input_unbounded(access),
        *_input_labels_raw(access),
        *_seeded(access),
    ]
    return tuple(sorted(found, key=lambda f: (f.severity.rank, f.code)))
