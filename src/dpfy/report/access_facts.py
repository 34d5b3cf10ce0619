"""The access model of a run (guide §3.2, table 1) as a fact, and the sentence the report states.

The guide separates where DP applies: input-level (the data itself is privatised, per record),
label-only (only labels are private, features public), full training (features and labels,
DP-SGD) and prediction-level (only served answers are released). A report must say which one its
ε is about, because the same ε protects very different things under each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpfy.report.json_codec import build

__all__ = ["ACCESS_MODELS", "AccessFacts", "access_statement"]

#: Each access model's §3.2 line: what the guarantee protects, and against whom.
ACCESS_MODELS: dict[str, str] = {
    "full": (
        "full-training DP (guide §3.2): features and labels of the training data are protected; "
        "the released model carries the guarantee"
    ),
    "label": (
        "label-only DP (guide §3.2): only the labels are protected — neighbouring datasets "
        "differ in one example's label, and the features are treated as public, so nothing "
        "protects them"
    ),
    "input": (
        "input-level DP (guide §3.2): each record was privatised by a local randomiser before "
        "any training, so the data itself, not the model, carries the guarantee — local DP, "
        "per record; anything trained on the randomised records is post-processing"
    ),
    "prediction": (
        "prediction-level DP (guide §3.2): only the served answers are protected and the model "
        "itself is never released"
    ),
}


@dataclass(frozen=True)
class AccessFacts:
    """Which access model the run's ε is about, and what that model's randomiser did.

    ``epsilon``/``delta`` are set for the access models accounted outside the DP-SGD ledger
    (label: pure ε per label; input: ε per record, δ for a Gaussian randomiser). ``mechanism``
    names the randomiser; ``detail`` is its one-line description (noise scale, stages).
    ``features_public``: the user declared the features public (what label-only DP assumes);
    ``bounds``: where an input-level run's public feature bounds come from (None: unbounded).
    ``seeded``: the randomisation was drawn from a fixed seed (an experiment, not private).
    """

    model: str = "full"
    epsilon: float | None = None
    delta: float = 0.0
    mechanism: str | None = None
    detail: str | None = None
    features_public: bool = False
    bounds: str | None = None
    labels_protected: bool = True
    seeded: bool = False

    def __post_init__(self) -> None:
        if self.model not in ACCESS_MODELS:
            raise ValueError(
                f"access model must be one of {', '.join(ACCESS_MODELS)}; got {self.model!r}"
            )

    @classmethod
    def from_dict(cls, data: Any) -> AccessFacts:
        """Inverse of ``dataclasses.asdict``; a problem names the field."""
        return build(cls, data, where="access")


def access_statement(access: AccessFacts) -> str:
    """The report's §3.2 line: the access model and what it protects."""
    line = f"Access model: {ACCESS_MODELS[access.model]}."
    if access.model == "input" and not access.labels_protected:
        line += " The labels were not randomised: only the features are protected."
    if access.detail:
        line += f" {access.detail}"
    return line
