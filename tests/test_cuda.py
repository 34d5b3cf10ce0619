"""The GPU path: engines, noise and checkpoints on a CUDA device.

Skipped where no CUDA device is present (CI has none); run them on a GPU machine with
``pytest tests/test_cuda.py``. What they guard: noise is drawn on the parameters' device from
that device's own generator, a killed and resumed run continues the same run, and the engines'
sums match the batch-of-one reference on the device.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.train.grads import make_engine
from dpfy.train.noise.source import TorchNoise
from test_grads import TinyTransformer, assert_matches_reference, cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU = torch.device("cuda")


@pytest.fixture
def float64() -> Iterator[None]:
    """Reference comparisons in float64, as in test_grads."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_noise_for_a_gpu_tensor_comes_from_that_gpus_generator():
    source = TorchNoise(seed=4)
    cpu_before = source.generator.get_state()
    first = source.normal(torch.empty(1000, device=GPU), 2.0)
    assert first.device.type == "cuda"
    torch.testing.assert_close(source.generator.get_state(), cpu_before, rtol=0, atol=0)
    assert 1.8 < float(first.std()) < 2.2
    again = TorchNoise(seed=4).normal(torch.empty(1000, device=GPU), 2.0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)  # seeded: reproducible
    saved = source.state_dict()
    assert list(saved["devices"]) == [str(first.device)]
    expected = source.normal(first, 1.0)
    restored = TorchNoise(seed=99)
    restored.load_state_dict(saved)
    torch.testing.assert_close(restored.normal(first, 1.0), expected, rtol=0, atol=0)


def test_engines_match_the_reference_on_the_gpu(float64):
    torch.manual_seed(0)
    conv = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
    )  # fmt: skip
    embedding = nn.Sequential(
        nn.Embedding(11, 4), nn.LayerNorm(4), nn.Flatten(), nn.Linear(12, 3)
    )  # fmt: skip
    cases = [
        (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(7, 6)),
        (conv, torch.randn(6, 2, 5, 5)),
        (embedding, torch.randint(0, 11, (5, 3))),
    ]
    for model, x in cases:
        model = model.to(GPU)
        y = torch.randn(x.shape[0], 3, device=GPU)
        assert_matches_reference(model, x.to(GPU), y, microbatch=None)
        assert_matches_reference(model, x.to(GPU), y, microbatch=2, reduction="sum")


def test_transformer_encoder_runs_on_the_fast_engine_on_the_gpu(float64):
    torch.manual_seed(1)
    model = TinyTransformer(batch_first=True).to(GPU)
    tokens = torch.randint(1, 11, (5, 6), device=GPU)
    tokens[1, 4:] = 0  # padded example
    engine = make_engine(model)
    assert engine.kind == "fast", engine.fallback_reason
    engine.detach()
    y = torch.randint(0, 3, (5,), device=GPU)
    assert_matches_reference(model, tokens, y, loss_fn=cross_entropy, kinds=("fast",))


def zero_gradient_run(sigma: float, clip: float, batch: int, lr: float) -> dpfy.PrivateTraining:
    """A GPU model whose loss ignores its parameters: every update is noise alone."""

    class ZeroGradient(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1000, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * 0.0

    model = ZeroGradient().to(GPU)
    data = TensorDataset(torch.randn(400, 1000), torch.zeros(400))
    return dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=lr), data, batch_size=batch, steps=1,
        noise_multiplier=sigma, delta=1e-5, max_grad_norm=clip, seed=3,
    )  # fmt: skip


def test_update_noise_on_the_gpu_has_variance_sigma_c_over_b_times_lr_squared():
    """Zero gradients: one step moves each coordinate by lr·N(0, σ²C²)/B (chi-square test)."""
    lr, sigma, clip, batch = 0.5, 1.3, 0.7, 40
    private = zero_gradient_run(sigma, clip, batch, lr)
    before = torch.cat([p.detach().flatten() for p in private.model.parameters()])
    for x, _ in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        private.model(x.to(GPU)).sum().backward()
        private.optimizer.step()
    assert all(p.grad.device.type == "cuda" for p in private.model.parameters())
    after = torch.cat([p.detach().flatten() for p in private.model.parameters()])
    update = (after - before).double().cpu().numpy()
    statistic = float(np.sum(update**2) / (lr * sigma * clip / batch) ** 2)
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], update.size)
    assert lo < statistic < hi
    assert stats.normaltest(update).pvalue > 1e-4


def seeded_gpu_run(width: int, physical: int | None = None) -> dpfy.PrivateTraining:
    """A small seeded private run on the GPU; ``width`` sizes the first layer (filled last)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Linear(width, 3)).to(GPU)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(100, 5, generator=g), torch.randint(0, 3, (100,), generator=g))
    return dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=10, steps=8,
        noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, seed=11,
        max_physical_batch_size=physical,
    )  # fmt: skip


def train_on_gpu(private: dpfy.PrivateTraining, stop_after: int | None = None) -> None:
    """The usual loop, batches moved to the GPU, zero_grad() at its end."""
    private.optimizer.zero_grad()
    for taken, (x, y) in enumerate(private.loader, start=1):
        nn.functional.cross_entropy(private.model(x.to(GPU)), y.to(GPU)).backward()
        private.optimizer.step()
        private.optimizer.zero_grad()
        if taken == stop_after:
            return


def gpu_weights(private: dpfy.PrivateTraining) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in private.model.parameters()]).cpu()


class NoNoise:
    """Adds nothing (on the tensor's own device)."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


def test_a_gpu_run_killed_and_resumed_continues_the_same_run(tmp_path):
    whole = seeded_gpu_run(64)
    train_on_gpu(whole, stop_after=3)
    path = whole.save(tmp_path / "checkpoint.pt")
    resumed = seeded_gpu_run(64)
    resumed.load(path)
    probe = seeded_gpu_run(64)
    probe.load(path)
    train_on_gpu(probe, stop_after=1)
    train_on_gpu(resumed, stop_after=1)
    # Every resume draws fresh noise, on the GPU's generator too (a replayed stream would let two
    # continuations cancel it): two continuations of one checkpoint step apart.
    assert not torch.equal(gpu_weights(resumed), gpu_weights(probe))
    # Everything else continues exactly: silenced from the checkpoint on, both runs end alike.
    resumed = seeded_gpu_run(64)
    resumed.load(path)
    whole.optimizer.noise = resumed.optimizer.noise = NoNoise()
    train_on_gpu(whole)
    train_on_gpu(resumed)
    assert resumed.ledger.steps == whole.ledger.steps == 8
    assert resumed.epsilon() == pytest.approx(whole.epsilon(), rel=1e-12)
    torch.testing.assert_close(gpu_weights(resumed), gpu_weights(whole), rtol=0, atol=0)
