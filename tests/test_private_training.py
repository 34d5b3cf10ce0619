"""make_private and DPOptimizer: the privacy rules of DESIGN.md, statistically and exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import PlanComplete, rest_of_run
from dpfy.plan.accounting import PldAccountant, dpsgd_event
from dpfy.train.ledger import BudgetExhausted
from dpfy.train.noise import source as dpfy_noise
from dpfy.train.optim import NonFiniteGradientError


def dataset(n: int = 200, d: int = 5, classes: int = 3, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=generator))


def mlp(d: int = 5, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, classes))


def train(private: dpfy.PrivateTraining, stop_after: int | None = None) -> int:
    """The user's ordinary loop; returns the number of optimizer steps taken."""
    criterion = nn.CrossEntropyLoss()
    taken = 0
    for x, y in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        criterion(private.model(x), y).backward()
        private.optimizer.step()
        taken += 1
        if stop_after is not None and taken == stop_after:
            break
    return taken


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class ZeroGradientModel(nn.Module):
    """Its loss ignores the parameters' values: every per-example gradient is exactly zero."""

    def __init__(self, size: int = 4000) -> None:
        super().__init__()
        self.linear = nn.Linear(size // 2, 2, bias=False)
        self.scale = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 0.0 + self.scale(torch.zeros(x.shape[0], 1)) * 0.0


def test_update_noise_has_variance_sigma_c_over_b_times_lr_squared():
    """Zero gradients: one step moves each coordinate by lr·N(0, σ²C²)/B (chi-square test)."""
    model = ZeroGradientModel()
    data = TensorDataset(torch.randn(400, 2000), torch.zeros(400))
    lr, sigma, clip, batch = 0.5, 1.3, 0.7, 40
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    private = dpfy.make_private(
        model, optimizer, data, batch_size=batch, steps=1, noise_multiplier=sigma,
        delta=1e-5, max_grad_norm=clip, seed=3,
    )  # fmt: skip
    before = flat(model)
    for x, _ in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        private.model(x).sum().backward()
        private.optimizer.step()
    update = (flat(model) - before).double().numpy()
    expected_var = (lr * sigma * clip / batch) ** 2
    k = update.size
    statistic = float(np.sum(update**2) / expected_var)
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], k)
    assert lo < statistic < hi
    assert abs(stats.normaltest(update).pvalue) > 1e-4  # Gaussian shaped


def test_update_divides_by_the_expected_batch_size_not_the_realised_one():
    """DESIGN rule 1: with negligible noise, update = lr · Σ clipped / B_expected."""
    data = dataset(300)
    model = mlp()
    reference = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    private = dpfy.make_private(
        model, optimizer, data, batch_size=30, steps=1, noise_multiplier=1e-12,
        delta=1e-5, max_grad_norm=1e3, seed=5, loss_reduction="sum",
    )  # fmt: skip
    criterion = nn.CrossEntropyLoss(reduction="sum")
    for x, y in rest_of_run(private.loader):
        realised = x.shape[0]
        private.optimizer.zero_grad()
        criterion(private.model(x), y).backward()
        private.optimizer.step()
        criterion(reference(x), y).backward()
    assert realised != 30  # Poisson: the realised size differs from B (seeded)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        expected = r.detach() - r.grad / 30
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


def test_empty_batch_still_steps_with_noise_and_is_accounted():
    """DESIGN rule 3: q tiny → empty batches; parameters still move and ε grows."""
    data = dataset(1000)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dpfy.make_private(
        model, optimizer, data, batch_size=1, steps=20, noise_multiplier=1.0,
        delta=1e-6, max_grad_norm=1.0, seed=11,
    )  # fmt: skip
    sizes = []
    for x, y in rest_of_run(private.loader):
        sizes.append(x.shape[0])
        before = flat(model)
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
        if x.shape[0] == 0:
            assert not torch.equal(flat(model), before)
    assert 0 in sizes
    assert private.ledger.steps == 20
    expected = PldAccountant().compose(dpsgd_event(1 / 1000, 1.0, 20)).epsilon(1e-6)
    assert private.epsilon() == pytest.approx(expected)


def test_every_trainable_parameter_gets_noise_and_frozen_ones_never_change():
    """DESIGN rule 2: an unused layer's parameters move (noise); frozen ones stay put."""

    class PartlyUsed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(5, 3)
            self.unused = nn.Linear(5, 3)
            self.frozen = nn.Linear(5, 5)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(self.frozen(x))

    model = PartlyUsed()
    frozen_before = [p.clone() for p in model.frozen.parameters()]
    unused_before = [p.clone() for p in model.unused.parameters()]
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    private = dpfy.make_private(
        model, optimizer, dataset(), batch_size=20, steps=3, noise_multiplier=1.0,
        delta=1e-5, max_grad_norm=1.0, seed=2,
    )  # fmt: skip
    train(private)
    for before, after in zip(frozen_before, model.frozen.parameters(), strict=True):
        assert torch.equal(before, after)
    for before, after in zip(unused_before, model.unused.parameters(), strict=True):
        assert not torch.equal(before, after)


def test_budget_guard_stops_at_the_target_before_touching_the_model():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dpfy.make_private(
        model, optimizer, dataset(), batch_size=20, steps=40, target_epsilon=1.0,
        delta=1e-5, max_grad_norm=1.0, seed=4,
    )  # fmt: skip
    train(private)
    assert private.epsilon() <= 1.0
    spent = private.epsilon()
    steps = private.ledger.steps
    before = flat(model)
    with pytest.raises(PlanComplete, match="all 40 planned steps"):
        next(iter(private.loader))  # the loader holds no step beyond the plan
    private.loader.dp_sampler.total = None  # an edited loader: the ledger's guard still holds
    x, y = next(iter(private.loader))
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y).backward()
    # The calibrated run used its budget exactly; one more step would exceed it.
    with pytest.raises(BudgetExhausted, match="privacy budget exhausted"):
        private.optimizer.step()
    assert torch.equal(flat(model), before)
    assert private.ledger.steps == steps and private.epsilon() == spent


def test_calibrated_run_spends_at_most_the_target():
    model = mlp()
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(500), batch_size=50,
        epochs=2, target_epsilon=2.0, delta=1e-5, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    assert train(private) == 20
    assert 1.95 <= private.epsilon() <= 2.0


def test_kill_and_resume_gives_the_same_epsilon_and_model(tmp_path):
    def fresh() -> dpfy.PrivateTraining:
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        return dpfy.make_private(
            model, optimizer, dataset(), batch_size=20, steps=12, noise_multiplier=1.1,
            delta=1e-5, max_grad_norm=1.0, seed=7,
        )  # fmt: skip

    class NoNoise:
        def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
            return torch.zeros_like(like)

    # A resume draws fresh noise (replaying the stream would let two continuations cancel it), so
    # the same model is checked with the noise after the checkpoint silenced on both sides.
    uninterrupted = fresh()
    train(uninterrupted, stop_after=5)
    uninterrupted.optimizer.noise = NoNoise()
    train(uninterrupted)

    first = fresh()
    train(first, stop_after=5)
    checkpoint = first.save(tmp_path / "run" / "checkpoint.pt")
    del first  # "killed"

    resumed = fresh()
    resumed.load(checkpoint)
    assert resumed.ledger.steps == 5
    resumed.optimizer.noise = NoNoise()
    train(resumed)
    assert resumed.ledger.steps == 12
    assert resumed.epsilon() == pytest.approx(uninterrupted.epsilon(), rel=1e-12)
    torch.testing.assert_close(flat(resumed.model), flat(uninterrupted.model))


def test_corrupt_checkpoint_is_refused_and_changes_nothing(tmp_path):
    model = mlp()
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), batch_size=20, steps=3,
        noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, seed=1,
    )  # fmt: skip
    train(private, stop_after=2)
    good = private.save(tmp_path / "good.pt")
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(good.read_bytes()[:200])
    before, steps = flat(model), private.ledger.steps
    with pytest.raises(ValueError, match="corrupt"):
        private.load(corrupt)
    assert torch.equal(flat(model), before) and private.ledger.steps == steps
    assert good.exists()


def test_microbatch_noise_uses_twice_the_sensitivity():
    """Guide alg. 3: noise std 2σC on the sum, divided by the expected number of microbatches."""
    model = ZeroGradientModel()
    data = TensorDataset(torch.randn(400, 2000), torch.zeros(400))
    lr, sigma, clip, batch, k = 1.0, 0.9, 0.5, 40, 4
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=lr), data, batch_size=batch, steps=1,
        noise_multiplier=sigma, delta=1e-5, max_grad_norm=clip, microbatch_size=k, seed=9,
    )  # fmt: skip
    before = flat(model)
    for x, _ in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        private.model(x).sum().backward()
        private.optimizer.step()
    update = (flat(model) - before).double().numpy()
    expected_var = (lr * 2 * sigma * clip / (batch / k)) ** 2
    statistic = float(np.sum(update**2) / expected_var)
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], update.size)
    assert lo < statistic < hi


def test_virtual_batching_gives_the_same_update_as_one_physical_batch():
    """The same batches and clipped sums (noise negligible: its draw order follows the chunks)."""

    def run(physical: int | None) -> torch.Tensor:
        model = mlp()
        private = dpfy.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.5), dataset(), batch_size=40,
            steps=3, noise_multiplier=1e-9, delta=1e-5, max_grad_norm=0.5, seed=21,
            max_physical_batch_size=physical,
        )  # fmt: skip
        assert train(private) >= 3
        assert private.ledger.steps == 3
        return flat(model)

    torch.testing.assert_close(run(7), run(None), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_any_torch_optimizer_trains(name):
    data = dataset(400)
    model = mlp()
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.05)
    private = dpfy.make_private(
        model, optimizer, data, batch_size=40, epochs=3, noise_multiplier=0.5,
        delta=1e-5, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.StepLR(private.optimizer, step_size=10)
    train(private)
    scheduler.step()
    assert private.ledger.steps == math.ceil(3 * 400 / 40)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- bad input ------------------------------------------------------------------------------------
def bad(**overrides):
    model = overrides.pop("model", None) or mlp()
    arguments = {
        "batch_size": 20, "steps": 3, "noise_multiplier": 1.0, "delta": 1e-5,
        "max_grad_norm": 1.0,
    }  # fmt: skip
    arguments.update(overrides)
    data = arguments.pop("data", dataset())
    optimizer = arguments.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return dpfy.make_private(model, optimizer, data, **arguments)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))}, r"dpfy\.fix"),
        ({"batch_size": 1000}, "exceeds the dataset size"),
        ({"target_epsilon": 1.0}, "exactly one of target_epsilon"),
        ({"noise_multiplier": None}, "exactly one of target_epsilon"),
        ({"epochs": 2}, "exactly one of epochs"),
        ({"steps": None}, "exactly one of epochs"),
        ({"delta": 1.0}, "delta"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"data": TensorDataset(torch.zeros(0, 5), torch.zeros(0))}, "empty"),
        ({"model": nn.Sequential(nn.Linear(5, 3), nn.PReLU()), "engine": "fast"}, "engine='vmap'"),
    ],
)
def test_bad_input_is_refused_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        bad(**overrides)


def test_optimizer_built_before_fix_is_refused():
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="replaced"):
        fixed = dpfy.fix(model)
    with pytest.raises(ValueError, match=r"dpfy\.fix"):
        bad(model=fixed, optimizer=optimizer)


def test_non_finite_loss_changes_neither_model_nor_ledger():
    model = mlp()
    private = bad(model=model)
    before = flat(model)
    x, y = next(iter(private.loader))
    private.optimizer.zero_grad()
    (nn.functional.cross_entropy(private.model(x), y) * float("inf")).backward()
    with pytest.raises(NonFiniteGradientError, match="unchanged"):
        private.optimizer.step()
    assert torch.equal(flat(model), before) and private.ledger.steps == 0


def test_delta_above_one_over_n_warns():
    with pytest.warns(UserWarning, match="1/N"):
        bad(delta=0.01)


@pytest.mark.parametrize("source", [dpfy_noise.SecureNoise(), dpfy_noise.TorchNoise(seed=0)])
def test_noise_sources_draw_the_requested_gaussian(source):
    like = torch.zeros(50_000, dtype=torch.float64)
    draws = source.normal(like, 2.5).numpy()
    assert draws.shape == (50_000,) and draws.dtype == np.float64
    statistic = float(np.sum(draws**2) / 2.5**2)
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], draws.size)
    assert lo < statistic < hi
    assert stats.kstest(draws / 2.5, "norm").pvalue > 1e-4


def test_secure_noise_trains_and_differs_between_runs():
    def run() -> torch.Tensor:
        model = mlp()
        private = bad(model=model, secure_noise=True)
        train(private)
        return flat(model)

    assert not torch.equal(run(), run())
