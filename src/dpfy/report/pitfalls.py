"""Pitfall detectors: what in a run's facts weakens or voids its DP claim (guide §5.4–5.5).

Each detector is one small function registered with :func:`detector`; it reads a
:class:`~dpfy.report.facts.RunFacts` and returns zero or more :class:`Finding` s, each with the
evidence from the facts and the fix. :func:`find_pitfalls` runs them all; the report lists what
they find. Model checks that need the live model (batch-coupled or sparse layers,
:mod:`dpfy.train.checks`) are run when the facts are collected and read back here, so a saved run
is checked without torch. Mode-dependent phrases come from :mod:`dpfy.report.wording`. A
detector that reads un-noised statistics of the private data (the clip-norm check) is registered
with ``reads_diagnostics=True``: its findings go to the diagnostics file, not the card.

Severities: ``error`` — the stated guarantee is not established as reported; ``warning`` — the
guarantee holds but utility or comparability suffers; ``info`` — a fact a reader must know.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dpfy.plan.sampling import SamplingKind
from dpfy.report.accounting import planned_sampling
from dpfy.report.facts import LOSS_NORMALISATIONS, RunFacts
from dpfy.report.wording import unit_wording, wording_for

# C above this multiple of the median per-example norm: the noise σC dwarfs the clipped gradients.
CLIP_TOO_LARGE = 5.0
# C below this multiple of the median: nearly every example is clipped hard and loses direction.
CLIP_TOO_SMALL = 0.1


class Severity(str, enum.Enum):
    """How much a finding matters to the claim; ordered from worst."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """Sort key: errors first."""
        return list(Severity).index(self)


@dataclass(frozen=True)
class Finding:
    """One pitfall found in a run: what, how bad, the evidence, the fix, and the guide's section."""

    code: str
    severity: Severity
    title: str
    evidence: str
    fix: str
    guide_section: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "severity", Severity(self.severity))

    def to_dict(self) -> dict[str, str]:
        """Plain JSON."""
        return {
            "code": self.code,
            "severity": self.severity.value,
            "title": self.title,
            "evidence": self.evidence,
            "fix": self.fix,
            "guide_section": self.guide_section,
        }


Detector = Callable[[RunFacts], Iterable[Finding]]
DETECTORS: dict[str, Detector] = {}
#: The detectors that read un-noised statistics of the private data (the gradient norms). What
#: they find is itself such a statistic ("C is 20× the median norm"), so their findings go to the
#: diagnostics file, never to the card meant for publication (released facts only).
READS_DIAGNOSTICS: set[str] = set()


def detector(code: str, *, reads_diagnostics: bool = False) -> Callable[[Detector], Detector]:
    """Register a detector by name (its findings carry their own, possibly finer, codes).

    ``reads_diagnostics``: the detector reads un-noised statistics of the private data, so its
    findings are reported in the diagnostics file only.
    """

    def register(function: Detector) -> Detector:
        if code in DETECTORS:
            raise ValueError(f"a pitfall detector is already registered as {code!r}")
        DETECTORS[code] = function
        if reads_diagnostics:
            READS_DIAGNOSTICS.add(code)
        return function

    return register


def find_pitfalls(facts: RunFacts, *, diagnostics: bool = True) -> tuple[Finding, ...]:
    """Every finding of every registered detector, errors first.

    ``diagnostics=False`` runs only the detectors that read released or public facts: what the
    card meant for publication may state. The run's own terminal output shows them all.
    """
    checks = [
        check for code, check in DETECTORS.items() if diagnostics or code not in READS_DIAGNOSTICS
    ]
    found = [finding for check in checks for finding in check(facts)]
    return tuple(sorted(found, key=lambda f: (f.severity.rank, f.code)))


def diagnostic_pitfalls(facts: RunFacts) -> tuple[Finding, ...]:
    """The findings of the detectors that read un-noised diagnostics: the diagnostics file's."""
    checks = [check for code, check in DETECTORS.items() if code in READS_DIAGNOSTICS]
    found = [finding for check in checks for finding in check(facts)]
    return tuple(sorted(found, key=lambda f: (f.severity.rank, f.code)))


# -- detectors ------------------------------------------------------------------------------------


@detector("batch-coupled-layer")
def batch_coupled_layers(facts: RunFacts) -> Iterator[Finding]:
    """Layers that mix examples of a batch void per-example clipping."""
    for layer in facts.model.batch_coupled_layers:
        yield Finding(
            "batch-coupled-layer",
            Severity.ERROR,
            f"Batch-coupled layer {layer.path or '<model>'} ({layer.layer})",
            layer.problem,
            layer.fix,
            "§5.5.1",
        )


@detector("sampling-not-poisson")
def sampling_not_poisson(facts: RunFacts) -> Iterator[Finding]:
    """Shuffled batches are accounted as Poisson, an assumption they do not meet (guide §4.3)."""
    record = planned_sampling(facts.privacy)
    eps = facts.accounting.summary.total_epsilon
    if not record.assumption_met:
        yield Finding(
            "sampling-not-poisson",
            Severity.ERROR,
            "Shuffled batches accounted as Poisson sampling",
            f"batches were shuffled fixed-size (B={facts.privacy.expected_batch_size}), yet "
            f"ε = {eps:.4g} assumes Poisson sampling at q={facts.privacy.sampling_rate:.4g}; no "
            "ε is known for shuffling, so the reported ε is not a proven guarantee.",
            "train with the Poisson sampler (dpfy's default), or use a method that needs no "
            "sampling assumption (DP-FTRL); otherwise disclose the mismatch as this report does.",
            "§4.3, §5.3.1",
        )
    elif record.kind is SamplingKind.FIXED_SIZE:
        yield Finding(
            "sampling-not-poisson",
            Severity.WARNING,
            "Fixed-size batches: ε under replace-one adjacency",
            "batches were drawn uniformly at a fixed size; they are accounted honestly, but "
            "under the replace-one relation, whose ε is not comparable with add-or-remove "
            "figures.",
            "use Poisson sampling for an add-or-remove ε comparable with other work.",
            "§2.1, §4.3",
        )


@detector("delta-too-large")
def delta_too_large(facts: RunFacts) -> Iterator[Finding]:
    """δ ≥ 1/N allows a mechanism that publishes a random record outright (guide §2.1)."""
    n, delta = facts.privacy.dataset_size, facts.privacy.delta
    if delta >= 1.0 / n:
        yield Finding(
            "delta-too-large",
            Severity.ERROR,
            "δ is not below 1/N",
            f"δ = {delta:g} ≥ 1/N = {1 / n:g} (N = {n}): releasing one whole random record "
            "satisfies this (ε, δ) guarantee.",
            f"choose δ ≪ 1/N, e.g. δ ≤ {10 ** _floor_log10(0.1 / n):g}.",
            "§2.1",
        )


@detector("seeded-randomness")
def seeded_randomness(facts: RunFacts) -> Iterator[Finding]:
    """A chosen seed makes the noise replayable: DP needs randomness the adversary cannot know.

    A warning, not an error: a seeded run is an experiment (reproducible on purpose), and the
    guarantee holds while the seed stays secret; ``--strict`` makes it fail the command.
    """
    if facts.privacy.seeded:
        yield Finding(
            "seeded-randomness",
            Severity.WARNING,
            "sampling and noise were drawn from a chosen seed",
            "the run was given seed= (or --seed): anyone who learns that seed can regenerate the "
            "batches and subtract the noise, so the stated (ε, δ) holds only while the seed "
            "stays secret.",
            "for a model you release, leave the seed unset (sampling and noise from OS entropy, "
            "the default) or use secure_noise=True; keep seeds for reproducible experiments.",
            "§4.2",
        )


def _floor_log10(x: float) -> int:
    """The power of ten at or below ``x``."""
    exponent = 0
    while 10.0**exponent > x:
        exponent -= 1
    return exponent


@detector("user-level-claim")
def user_level_claim(facts: RunFacts) -> Iterator[Finding]:
    """A user-level claim from example-level sampling holds only if one example is one user."""
    declared, sampled = unit_wording(facts.training.unit), unit_wording(facts.privacy.unit)
    if not declared.groups_examples or sampled.groups_examples:
        return  # an example-level claim, or a run that samples and clips users: the claim holds
    yield Finding(
        "user-level-claim",
        Severity.WARNING,
        "User-level unit of privacy with example-level sampling and clipping",
        f"the run declares user-level privacy but sampled and clipped single examples "
        f"({facts.privacy.sampler} sampling over N = {facts.privacy.dataset_size} examples); "
        "the ε holds per user only if each training example holds all of one user's data.",
        "make each example one user's whole data, or train with user-level sampling and "
        "clipping (DP-FedAvg, guide alg. 2); otherwise report example-level privacy.",
        "§2.1, §4.4",
    )


@detector("preprocessing-fitted-on-private-data")
def preprocessing_on_private_data(facts: RunFacts) -> Iterator[Finding]:
    """Statistics, vocabularies or tokenizers learned from the private data leak it un-noised."""
    for step in facts.dataset.preprocessing:
        if step.fitted_on_private_data and not step.declared_public:
            yield Finding(
                "preprocessing-fitted-on-private-data",
                Severity.ERROR,
                f"Preprocessing '{step.name}' was fitted on the private data",
                f"{step.description or step.name} was learned from the training data without "
                "noise; whatever it encodes (normalisation statistics, a vocabulary, tokenizer "
                "merges) is released outside the DP guarantee.",
                "fit it on public data (and declare it public), use fixed constants, or compute "
                "it with a DP mechanism and account for it in the ledger.",
                "§5.5.1, tab. 5, app. A",
            )


@detector("sequence-loss-not-normalised")
def sequence_loss_not_normalised(facts: RunFacts) -> Iterator[Finding]:
    """Summed sequence losses make per-example norms grow with length, so C fits no one."""
    training = facts.training
    if not training.sequence_task:
        return
    norm = training.loss_normalisation
    if norm is None:
        yield Finding(
            "sequence-loss-not-normalised",
            Severity.WARNING,
            "Sequence loss normalisation not declared",
            "this is a sequence task but the trainer did not state how each example's loss is "
            "normalised, so whether gradient norms depend on sequence length is unknown.",
            f"declare loss_normalisation (one of {', '.join(LOSS_NORMALISATIONS)}); average "
            "each sequence's loss over its target tokens.",
            "§5.4.1",
        )
    elif not LOSS_NORMALISATIONS[norm]:
        yield Finding(
            "sequence-loss-not-normalised",
            Severity.WARNING,
            "Sequence loss not normalised by the number of target tokens",
            f"loss_normalisation = '{norm}': a per-example gradient norm grows with the sequence "
            "length, so long sequences are clipped hard and short ones are drowned by noise.",
            "average each sequence's loss over its target tokens ('per-token-mean').",
            "§5.4.1",
        )


@detector("behaviour-checks")
def behaviour_checks(facts: RunFacts) -> Iterator[Finding]:
    """The run's own code coupled examples (an error), or was not fully probed (a warning)."""
    checks = facts.behaviour_checks
    if checks is None:
        return
    refused = {n: c for n, c in checks.items() if c.get("status") == "refused"}
    if refused:
        named = "; ".join(f"{name}: {c.get('detail', '')}" for name, c in refused.items())
        yield Finding(
            "examples-coupled",
            Severity.ERROR,
            "The run's own code made examples depend on each other",
            f"a behaviour check refused a step: {named}. Clipping then does not bound one "
            "example's influence, so the stated ε does not hold for such steps.",
            "make the collate_fn, model and loss per-example (GroupNorm/LayerNorm, a loss with "
            "reduction='sum' or a per-example mean, statistics from public data), then train "
            "again from a checkpoint taken before the refusal.",
            "§5.5.1",
        )
    unverified = {n: c for n, c in checks.items() if c.get("status") == "not run"}
    if unverified:
        named = "; ".join(f"{name}: {c.get('detail', '')}" for name, c in unverified.items())
        yield Finding(
            "behaviour-checks-incomplete",
            Severity.WARNING,
            "Part of the run's own code was not checked for coupled examples",
            f"not verified by behaviour: {named}.",
            "give make_private criterion= and call private.criterion in the loop; keep the "
            "checks' schedule on (dpfy.CheckSchedule).",
            "§5.5.1",
        )


@detector("frozen-parameters")
def frozen_parameters(facts: RunFacts) -> Iterator[Finding]:
    """Frozen parameters are released as they were before training: they must be public."""
    model = facts.model
    if model.frozen_names:
        shown = ", ".join(model.frozen_names[:8]) + (" …" if len(model.frozen_names) > 8 else "")
        yield Finding(
            "frozen-parameters",
            Severity.INFO,
            f"{len(model.frozen_names)} frozen parameter tensor(s) ({model.frozen:,} values)",
            f"not trained and released unchanged: {shown}. DP covers only what training "
            "changed; these values must not depend on the private data.",
            "initialise frozen parameters at random or from public pre-training only.",
            "§5.3.3, §5.5",
        )


@detector("unnoised-parameters")
def unnoised_parameters(facts: RunFacts) -> Iterator[Finding]:
    """A trainable parameter the engine does not noise would be trained without DP."""
    names = facts.model.unnoised_trainable_names
    if names:
        yield Finding(
            "unnoised-parameters",
            Severity.ERROR,
            "Trainable parameters outside the private optimizer",
            f"{len(names)} trainable tensor(s) are not noised by the engine: {', '.join(names)}.",
            "freeze them (requires_grad=False) or let make_private see them.",
            "§4.2, tab. 5",
        )


@detector("sparse-gradients")
def sparse_gradients(facts: RunFacts) -> Iterator[Finding]:
    """Sparse-gradient layers: dpfy noises every coordinate, which the report must state."""
    for layer in facts.model.sparse_layers:
        yield Finding(
            "sparse-gradients",
            Severity.INFO,
            f"Sparse-gradient layer {layer.path or '<model>'} ({layer.layer})",
            layer.problem,
            layer.fix,
            "§5.4.1, tab. 5",
        )


@detector("clip-norm-mismatch", reads_diagnostics=True)
def clip_norm_mismatch(facts: RunFacts) -> Iterator[Finding]:
    """C far above the typical norm lets noise swamp the signal; far below loses information.

    It reads the un-noised gradient-norm statistics, so it reports in the diagnostics file only.
    """
    stats = facts.grad_norms
    if stats is None or stats.median <= 0:
        return
    clip, median = stats.max_grad_norm, stats.median
    ratio = clip / median
    unit, clipped = facts.privacy.clipping_unit, wording_for(facts.privacy).algorithm.clipped
    evidence = (
        f"C = {clip:g}, median per-{unit} {clipped} norm = {median:.4g} (C = {ratio:.3g} × "
        f"median), {stats.fraction_clipped:.0%} of {stats.count} {unit} {clipped}s clipped"
    )
    if ratio > CLIP_TOO_LARGE:
        yield Finding(
            "clip-norm-too-large",
            Severity.WARNING,
            "Clip norm far above the typical gradient norm: noise swamps the signal",
            f"{evidence}; the noise std σC = {facts.privacy.noise_multiplier * clip:.4g} per "
            "coordinate is scaled to C while the gradients are much smaller.",
            "lower C towards the median norm (ClipSearch: sweep C without noise and take the "
            "smallest that costs little accuracy), then retune the learning rate.",
            "§5.4.1, fig. 2",
        )
    elif ratio < CLIP_TOO_SMALL:
        yield Finding(
            "clip-norm-too-small",
            Severity.WARNING,
            "Clip norm far below the typical gradient norm: information is lost",
            f"{evidence}; almost every gradient is scaled down to C, keeping only its direction.",
            "raise C (ClipSearch) and retune the learning rate with it.",
            "§5.4.1",
        )


@detector("tuning-not-accounted")
def tuning_not_accounted(facts: RunFacts) -> Iterator[Finding]:
    """Tuning trials on private data spend privacy; absent from the ledger, ε understates it."""
    tuning = facts.tuning
    if tuning.data != "private" or tuning.trials == 0:
        return
    if _labelled_events(facts):
        return
    yield Finding(
        "tuning-not-accounted",
        Severity.ERROR,
        "Hyperparameter tuning on private data is not accounted",
        f"{tuning.trials} tuning trial(s) ran on the private data but the ledger holds no "
        "tuning event, so the total ε covers the final training run only.",
        "record the tuning runs (ledger.record_event(..., label='tuning'): runs as epochs, the "
        "exponential mechanism, or a random number of trials), or tune on public data.",
        "§5.4.2",
    )


@detector("tuning-grid-edge")
def tuning_grid_edge(facts: RunFacts) -> Iterator[Finding]:
    """A choice at the edge of its grid may be short of the best, which lies beyond the grid."""
    edges = facts.tuning.grid_edges
    if not edges:
        return
    yield Finding(
        "tuning-grid-edge",
        Severity.WARNING,
        "Tuning chose a value at the edge of its grid",
        " ".join(edges),
        "extend the grid past that edge and tune again; a new tuning run on private data "
        "spends privacy budget too.",
        "§5.4.2",
    )


def _labelled_events(facts: RunFacts) -> dict[str, Any]:
    """The ledger's non-training labels and their counts."""
    return dict(facts.accounting.summary.labelled_events)


__all__ = [
    "CLIP_TOO_LARGE",
    "CLIP_TOO_SMALL",
    "DETECTORS",
    "READS_DIAGNOSTICS",
    "Finding",
    "Severity",
    "detector",
    "diagnostic_pitfalls",
    "find_pitfalls",
]
