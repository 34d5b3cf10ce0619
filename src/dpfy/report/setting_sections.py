"""Report items 1–4 (guide §5.3.3): the DP setting, what is released, the unit, the relation.

Each says what the claim is about; the algorithm's and unit's own phrases come from the run's
:class:`~dpfy.report.wording.Wording`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpfy.report.access_facts import access_statement
from dpfy.report.run_parts import RELEASES, UNITS
from dpfy.report.sections import paragraph, section

if TYPE_CHECKING:
    from dpfy.report.facts import RunFacts
    from dpfy.report.pitfalls import Finding
    from dpfy.report.wording import Wording


@section("dp_setting", "1. DP setting", paragraph)
def dp_setting(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """Central DP with a trusted curator: dpfy's trainer (or server) sees the raw data (§3.1)."""
    algorithm = words.algorithm
    statement = (
        f"Central differential privacy with {algorithm.curator}. Protection covers features "
        f"and labels (full-training DP via {algorithm.name}, {algorithm.guide})."
    )
    ranks = facts.privacy.world_size
    if ranks > 1:  # dpfy.train.distributed: the ranks and their all-reduce are the trusted curator
        statement += (
            f" Training ran in {ranks} processes (torch.distributed): each Poisson-sampled its "
            "shard of the data at the same q and added an independent noise share, the shares "
            "summing to one N(0, σ²C²) on the all-reduced sum; the processes and the channel "
            "between them are trusted. The un-noised diagnostics (diagnostics.md, not part of "
            "this card) cover rank 0's shard only."
        )
    statement += f" {access_statement(facts.access)}"
    access = facts.access.model
    return {"model": "central", "curator": "trusted", "access": access, "statement": statement}


@section("released", "2. What is released", paragraph)
def released(facts: RunFacts, findings: tuple[Finding, ...], words: Wording) -> dict[str, Any]:
    """What leaves the curator; everything computed from DP outputs is post-processing (§2.2).

    A fine-tuned model names its public starting point: the guarantee covers only the private
    training data, so the pretrained weights and tokenizer must not have seen it.
    """
    outputs = facts.training.released
    statement = (
        f"Released: {RELEASES[outputs]}. Released models are computed only from their "
        f"public initialisation and {words.algorithm.released_from}, so they are "
        "post-processing of the DP outputs and carry the same guarantee (guide §2.2); the ε "
        f"below covers all {facts.training.steps_taken} {words.algorithm.steps}."
    )
    public = [item.describe() for item in facts.public_inputs]
    if public:
        statement += (
            f" Public, not private (the initialisation above): {'; '.join(public)}. They were "
            "not trained on the private data, the guarantee does not cover them, and anything "
            "they were pretrained on is outside it."
        )
    return {"outputs": outputs, "public": public, "statement": statement}


@section("unit_of_privacy", "3. Unit of privacy", paragraph)
def unit_of_privacy(
    facts: RunFacts, findings: tuple[Finding, ...], words: Wording
) -> dict[str, Any]:
    """Which record the guarantee protects (guide §2.1); a user-level run says what a user is."""
    unit = facts.training.unit
    statement = f"Unit of privacy: {UNITS[unit]} (guide §2.1)."
    data: dict[str, Any] = {"unit": unit, "statement": statement}
    p = facts.privacy
    if words.unit.groups_examples:
        cap = p.max_examples_per_user
        used = (
            "all of their examples"
            if cap is None
            else f"at most {cap} of their examples (drawn uniformly each time the user is sampled)"
        )
        detail = words.variant.detail.format(
            users=p.dataset_size, examples=p.examples, q=p.sampling_rate, used=used
        )
        data.update(users=p.dataset_size, examples=p.examples, max_examples_per_user=cap)
        data["statement"] = f"{statement} {detail}"
    return data


_RELATIONS = {
    "add-or-remove": "neighbouring datasets differ by adding or removing {record}",
    "zero-out": "neighbouring datasets differ by replacing {record} with a null record",
    "replace-one": (
        "neighbouring datasets differ by replacing {record} with another (this doubles the "
        "sensitivity of a sum of clipped gradients)"
    ),
}


def _render_relation(data: dict[str, Any]) -> list[str]:
    """The relation and the comparability warning."""
    return [data["statement"], "", data["comparability"]]


@section("neighbouring_relation", "4. Neighbouring relation", _render_relation)
def neighbouring_relation(
    facts: RunFacts, findings: tuple[Finding, ...], words: Wording
) -> dict[str, Any]:
    """Adjacency from the ledger, which refuses to mix relations."""
    relation = facts.accounting.summary.relation
    meaning = _RELATIONS[relation].format(record=words.unit.record)
    return {
        "relation": relation,
        "statement": f"Neighbouring relation: {relation} — {meaning}.",
        "comparability": (
            "ε under different neighbouring relations is not comparable: replace-one roughly "
            "doubles the sensitivity of add-or-remove (guide §2.1)."
        ),
    }


SECTIONS = (dp_setting, released, unit_of_privacy, neighbouring_relation)

__all__ = ["SECTIONS"]
