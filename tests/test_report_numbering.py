"""report.md reads in order: the guide's §5.3.3 items numbered 1 to 9 without an unnumbered
section between them (the ε table is a subsection of §7), then the other sections."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy


def test_the_numbered_items_run_one_to_nine_without_a_gap(tmp_path):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    model = nn.Linear(4, 2)
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, (x[:, 0] > 0).long()),
        batch_size=16, steps=2, noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    for batch, labels in private.loader:
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.model(batch), labels).backward()
        private.optimizer.step()
    markdown = (private.report(tmp_path / "run")["markdown"]).read_text()
    headings = re.findall(r"^## (.+)$", markdown, flags=re.MULTILINE)
    numbers = [int(h.split(".")[0]) for h in headings if h.split(".")[0].isdigit()]
    assert numbers == list(range(1, 10))
    last = headings.index("9. Software")
    assert all(h.split(".")[0].isdigit() for h in headings[: last + 1]), headings
    assert "### ε at other δ, PLD beside RDP" in markdown
    assert markdown.index("## 7. Privacy budget") < markdown.index("### ε at other δ")
    assert markdown.index("### ε at other δ") < markdown.index("## 8. Hyperparameters")
