"""dpfy.lightning: a Lightning fit whose every optimizer step is dpfy's private step (CPU).

Accumulated pieces give the whole-batch step exactly, the fit runs the planned steps with one
ledger entry each, the report card is written, and a fit set up otherwise is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

pl = pytest.importorskip("lightning.pytorch")
dpl = pytest.importorskip("dpfy.lightning")


class NoNoise:
    """Adds nothing: the update is the clipped average alone (tests only)."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.run: dpl.PrivateLightning | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return self.run.optimizer


def data(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=generator) * 3, torch.arange(n) % 3)


def prepared(pieces: int, **options) -> Classifier:
    module = Classifier()
    settings = dict(
        batch_size=16, epochs=2, noise_multiplier=1.0, delta=1e-5, max_grad_norm=0.5, seed=3
    )
    settings.update(options)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    module.run = dpl.make_private(
        module, optimizer, data(), accumulate_grad_batches=pieces, **settings
    )
    return module


def fit(module: Classifier, **trainer_options) -> pl.Trainer:
    run = module.run
    settings = dict(
        max_steps=run.max_steps, accumulate_grad_batches=run.pieces, callbacks=[run.callback],
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    settings.update(trainer_options)
    trainer = pl.Trainer(**settings)
    trainer.fit(module, train_dataloaders=run.loader)
    return trainer


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_accumulated_pieces_in_lightning_take_the_whole_batch_step():
    whole, pieces = prepared(1), prepared(3)
    whole.run.private.optimizer.noise = pieces.run.private.optimizer.noise = NoNoise()
    fit(whole)
    trainer = fit(pieces)
    assert trainer.global_step == pieces.run.max_steps == 8  # 2 epochs of N/B = 4
    assert whole.run.private.ledger.steps == pieces.run.private.ledger.steps == 8
    torch.testing.assert_close(flat(pieces), flat(whole), rtol=1e-5, atol=1e-6)
    assert not torch.equal(flat(whole), flat(Classifier()))  # it trained


def test_the_fit_writes_the_report_card(tmp_path):
    module = prepared(2, report_dir=None)
    module.run.callback.report_dir = tmp_path / "report"
    fit(module, precision="bf16-mixed")
    assert (tmp_path / "report" / "report.md").exists()
    assert module.run.private.epsilon() > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"accumulate_grad_batches": 1}, "accumulate_grad_batches is 1"),
        ({"max_steps": 3}, "planned"),
        ({"gradient_clip_val": 1.0}, "gradient_clip_val"),
        ({"limit_train_batches": 3}, "limit_train_batches is 3"),
    ],
)
def test_a_fit_that_differs_from_the_plan_is_refused_before_any_step(options, message):
    module = prepared(2)
    before = flat(module)
    with pytest.raises(ValueError, match=message):
        fit(module, **options)
    assert torch.equal(flat(module), before) and module.run.private.ledger.steps == 0


def test_a_plain_optimizer_from_configure_optimizers_is_refused():
    module = prepared(2)
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"run\.optimizer"):
        fit(module)
    assert module.run.private.ledger.steps == 0


def test_a_fit_over_more_processes_than_the_private_run_is_refused(monkeypatch):
    module = prepared(2)
    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="processes"):
        fit(module)
    assert module.run.private.ledger.steps == 0


def test_dpfy_chunking_inside_lightning_pieces_is_refused():
    # Lightning would count every chunk of a batch as a step of its own.
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        prepared(2, max_physical_batch_size=4)
