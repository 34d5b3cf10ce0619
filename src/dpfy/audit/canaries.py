"""White-box gradient canaries: records whose clipped gradient is a Dirac on one coordinate.

Nasr et al. 2023 ("Tight auditing of differentially private machine learning", §3–4) audit
DP-SGD with *Dirac* gradient canaries: a canary's gradient is C times a basis vector e_k of a
coordinate no other record moves, so the observed update on k is (C·[canary in the batch] +
noise)/B, and the attack reads it off every intermediate model.

A canary here is an ordinary record of an ordinary dataset, drawn by the run's own sampler: its
input row is ``scale · e_k`` and the audit model is one bias-free linear map of the row onto a
single output, whose sum is the loss. The per-example gradient of that output with respect to
the map's weights is the row itself, so a canary's gradient is ``scale · e_k`` (clipped to
C · e_k when ``scale ≥ C``) and a blank record's row of zeros has gradient 0. Because the loss is
linear in the weights, the gradient does not depend on the model: every step of a session is a
fresh draw of the same one-step mechanism. The coordinates past the canaries (*probes*) receive
noise only; their spread tells the auditor the noise scale of each step, which a correct step
keeps fixed (a step that divides by the realised batch size does not).

Which neighbouring dataset the "out" side is follows the run's relation: the canary's record
removed (add-or-remove), its row zeroed (zero-out, DP-FTRL's order-keeping relation) or replaced
by the opposite Dirac ``−scale · e_k`` (replace-one: the worst replacement, sensitivity 2C).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: How the "out" side of each canary is formed, by the plan's neighbouring relation.
OUT_SIDES = {"add-or-remove": "removed", "zero-out": "zeroed", "replace-one": "negated"}


class CanaryModel(nn.Module):
    """One bias-free linear map of each record's row onto one output (zero-initialised).

    Its weight coordinates 0..canaries−1 belong to the canaries, the rest are probes.
    """

    def __init__(self, coordinates: int) -> None:
        super().__init__()
        self.layer = nn.Linear(coordinates, 1, bias=False)
        nn.init.zeros_(self.layer.weight)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Each record's output; its gradient with respect to the weights is its own row."""
        return self.layer(rows).squeeze(-1)

    @property
    def weights(self) -> torch.Tensor:
        """The flat weight vector the auditor watches (a view of the parameter)."""
        return self.layer.weight.detach()[0]


class IndexedCanaryModel(nn.Module):
    """The same Dirac canaries stored as indices: record i is canary ``i`` (−1: a blank).

    One weight per coordinate (an ``nn.Embedding`` of width 1, zero-initialised); a record's
    output is ``scale · w[i]`` (0 for a blank), so its gradient is ``scale · e_i`` as in
    :class:`CanaryModel`, without a dense row per record: an audit can then hold 10⁴ canaries
    and 10⁴ noise-only coordinates in every step, each a trial of its own.
    """

    def __init__(self, coordinates: int, scale: float) -> None:
        super().__init__()
        self.table = nn.Embedding(coordinates, 1)
        nn.init.zeros_(self.table.weight)
        self.scale = float(scale)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """Each record's output: ``scale · w[i]``, or 0 (no gradient) for a blank."""
        present = (indices >= 0).to(self.table.weight.dtype)
        return self.table(indices.clamp(min=0)).squeeze(-1) * (self.scale * present)

    @property
    def weights(self) -> torch.Tensor:
        """The flat weight vector the auditor watches (a view of the parameter)."""
        return self.table.weight.detach()[:, 0]


@dataclass(frozen=True)
class CanaryDesign:
    """The audit's records: ``canaries`` Dirac canaries, ``probes`` noise-only coordinates.

    ``scale`` is each canary's gradient norm before clipping (≥ C, so a correct step clips it to
    exactly C); ``records`` is the number of records the run samples from, canaries included
    when all are in.
    """

    canaries: int
    probes: int
    records: int
    scale: float

    def __post_init__(self) -> None:
        if self.canaries < 1:
            raise ValueError(f"canaries must be at least 1, got {self.canaries}")
        if self.probes < 0:
            raise ValueError(f"probes must be 0 or more, got {self.probes}")
        if self.records < self.canaries:
            raise ValueError(
                f"the audit samples from {self.records} records but needs {self.canaries} "
                "canaries among them; use fewer canaries or more records"
            )
        if not self.scale > 0:
            raise ValueError(f"scale must be positive, got {self.scale}")

    @property
    def coordinates(self) -> int:
        """Width of the audit model's weight vector: canaries, then probes."""
        return self.canaries + self.probes

    @property
    def blanks(self) -> int:
        """Records that are not canaries: rows of zeros, gradient 0."""
        return self.records - self.canaries


def audit_rows(design: CanaryDesign, included: torch.Tensor, relation: str) -> torch.Tensor:
    """The dataset's rows: each canary in (``included[k]``) or on its out side, then the blanks.

    The out side of canary k is its relation's (:data:`OUT_SIDES`): removed, zeroed, negated.
    """
    blanks = torch.zeros(design.blanks, design.coordinates)
    return torch.cat([canary_rows(design, included, relation), blanks])


def canary_rows(design: CanaryDesign, included: torch.Tensor, relation: str) -> torch.Tensor:
    """The canaries' rows alone (the blanks, all zeros, follow them in the dataset)."""
    if relation not in OUT_SIDES:
        raise ValueError(
            f"no white-box canary is defined for the relation {relation!r}; "
            f"one of {', '.join(OUT_SIDES)}"
        )
    included = torch.as_tensor(included, dtype=torch.bool)
    if included.shape != (design.canaries,):
        raise ValueError(
            f"included needs one flag per canary ({design.canaries}), got shape "
            f"{tuple(included.shape)}"
        )
    diracs = torch.eye(design.canaries, design.coordinates) * design.scale
    side = OUT_SIDES[relation]
    if side == "negated":
        return torch.where(included[:, None], diracs, -diracs)
    if side == "zeroed":
        return diracs * included[:, None]
    return diracs[included]


def out_mean(relation: str) -> float:
    """Mean of a canary coordinate's normalised update when its record is out and sampled."""
    return -1.0 if OUT_SIDES.get(relation) == "negated" else 0.0


def coin_generator(seed: int | None) -> torch.Generator:
    """The generator of the canaries' fair coins: from ``seed``, or from the OS."""
    flips = torch.Generator()
    if seed is None:
        flips.seed()
    else:
        flips.manual_seed(seed)
    return flips


__all__ = [
    "OUT_SIDES",
    "CanaryDesign",
    "CanaryModel",
    "IndexedCanaryModel",
    "audit_rows",
    "canary_rows",
    "coin_generator",
    "out_mean",
]
