"""Truncated Poisson sampling with static shapes: the sampler, the padding marks, the engine's
exact masking against a per-example reference, the accounting against dp_accounting, refusals."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from scipy import optimize, stats
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import DPDataLoader
from dpfy.data.padding import PAD_INDEX, Padding
from dpfy.data.sampling import TruncatedPoissonSampler, make_sampler
from dpfy.plan.accounting import make_accountant
from dpfy.plan.accounting.events import (
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
    TruncatedPoissonSampledEvent,
)
from dpfy.plan.accounting.truncation import max_batch_size_for, truncation_probability
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.plan.variants import PlanRequest, make_plan
from dpfy.train.grads import make_engine


def _sampler(n: int = 500, q: float = 0.1, cap: int = 45, steps: int = 200, seed: int = 0):
    return TruncatedPoissonSampler(
        n, q, cap, steps, torch.Generator().manual_seed(seed), total=steps
    )


# ---------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------
def test_every_batch_has_exactly_m_rows_and_marks_its_padding():
    sampler = _sampler()
    cut = 0
    for position, batch in enumerate(sampler, start=1):
        padding = sampler.padding(position)
        assert len(batch) == padding.rows == 45
        examples, pad = batch[: padding.real], batch[padding.real :]
        assert len(set(examples)) == len(examples)  # distinct examples
        assert all(i == PAD_INDEX for i in pad)
        cut += padding.real == 45
    assert cut > 0  # q·N = 50 > 45: most batches were cut to M


def test_uncut_batches_are_the_poisson_draw():
    """Below the cap the sampler is plain Poisson: same generator, same examples."""
    truncated = _sampler(q=0.02, cap=500)
    plain = make_sampler("poisson", 500, 10, 200, torch.Generator().manual_seed(0), total=200)
    for position, (a, b) in enumerate(zip(truncated, plain, strict=True), start=1):
        assert a[: truncated.padding(position).real] == b


def test_cut_keeps_a_uniform_subset():
    """Which examples a cut keeps does not depend on their index (each kept equally often)."""
    sampler = TruncatedPoissonSampler(40, 0.9, 10, 1, torch.Generator().manual_seed(3), total=4000)
    counts = torch.zeros(40)
    for _ in range(4000):
        for batch in sampler:
            counts[batch] += 1
    expected = counts.sum() / 40
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(chi2, 39) > 1e-4


def test_resumed_sampler_draws_the_same_batches_and_padding():
    first = _sampler(steps=20)
    drawn = [b for b in first]
    second = _sampler(steps=20, seed=99)
    with pytest.raises(ValueError, match="mismatch"):
        make_sampler("truncated-poisson", 500, 50, 20, total=20, max_batch_size=46).load_state_dict(
            first.state_dict(position=10)
        )
    second.load_state_dict(first.state_dict(position=10))
    assert [b for b in second] == drawn[10:]
    assert second.padding(20) == first.padding(20)


def test_loader_publishes_the_examples_not_the_rows():
    data = TensorDataset(torch.arange(300.0).unsqueeze(1))
    loader = DPDataLoader(
        data, 30, steps=5, sampler="truncated-poisson", max_batch_size=60,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    for (x,) in loader:
        drawn = loader.provenance.current
        assert x.shape[0] == 60 and drawn.padding.rows == 60
        assert drawn.size == drawn.padding.real
        assert torch.all(x[drawn.size :] == data[PAD_INDEX][0])


def test_padding_chunks_keep_examples_first():
    padding = Padding(10, 6)
    assert padding.chunk(0, 4) == Padding(4, 4)
    assert padding.chunk(4, 8) == Padding(4, 2)
    assert padding.chunk(8, 10) == Padding(2, 0)
    assert padding.mask().tolist() == [True] * 6 + [False] * 4
    with pytest.raises(ValueError, match="cannot hold"):
        Padding(3, 4)


# ---------------------------------------------------------------------------------------------
# The engine: padding rows contribute exactly nothing
# ---------------------------------------------------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float):
    """Σ_i min(1, C/‖g_i‖)·g_i from one backward pass per example."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    norms = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        norms.append(norm)
        for n, g in grads.items():
            total[n] += min(1.0, clip / norm) * g
    model.zero_grad(set_to_none=True)
    return total, torch.tensor(norms)


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_padding_rows_weigh_exactly_nothing_against_a_per_example_reference(kind):
    model = _model()
    gen = torch.Generator().manual_seed(1)
    real, rows = 5, 9
    x, y = torch.randn(rows, 4, generator=gen), torch.randint(0, 3, (rows,), generator=gen)
    expected, norms = _reference(model, x[:real], y[:real], 0.5)
    engine = make_engine(model, kind)
    nn.functional.cross_entropy(model(x), y).backward()  # mean over all 9 rows, padding included
    result = engine.clip_and_accumulate(0.5, "mean", padding=Padding(rows, real))
    assert result.num_examples == result.num_units == real == engine.num_examples
    torch.testing.assert_close(result.norms, norms.to(result.norms.dtype))
    for name, total in engine.summed_grads().items():
        torch.testing.assert_close(total, expected[name], rtol=1e-5, atol=1e-6)
    engine.detach()


def test_the_content_of_padding_rows_never_reaches_the_sum():
    """Two batches that differ only in their padding rows give bit-identical sums."""
    model = _model()
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    other = x.clone()
    other[5:] = 100 * torch.randn(3, 4, generator=gen)
    engine = make_engine(model, "fast")
    sums = []
    for batch in (x, other):
        nn.functional.cross_entropy(model(batch), y).backward()
        engine.clip_and_accumulate(1.0, "mean", padding=Padding(8, 5))
        sums.append({n: t.clone() for n, t in engine.summed_grads().items()})
        engine.reset()
    for name in sums[0]:
        assert torch.equal(sums[0][name], sums[1][name])
    engine.detach()


def test_a_batch_cut_after_padding_is_refused():
    model = _model()
    engine = make_engine(model, "fast")
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="padded this batch to 8 rows but the step saw 6"):
        engine.clip_and_accumulate(1.0, "mean", padding=Padding(8, 5))
    engine.detach()


def _private(seed: int = 5, sigma: float = 1.0, **options):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(300, 4), torch.randint(0, 3, (300,)))
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dpfy.make_private(
        model, optimizer, data, batch_size=20, delta=1e-5, max_grad_norm=1.0, steps=6,
        noise_multiplier=sigma, sampler="truncated-poisson", max_batch_size=60, seed=seed,
        **options,
    )  # fmt: skip
    return private


def test_private_step_on_padded_batches_counts_only_examples():
    private = _private()
    seen = []
    for x, y in private.loader:
        assert x.shape[0] == 60
        nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
        private.optimizer.zero_grad()
        seen.append(private.loader.provenance.current.padding.real)
    assert private.ledger.steps == 6
    assert all(0 <= r < 60 for r in seen)
    events = private.ledger.events().events
    assert {type(e.event) for e in events} == {TruncatedPoissonSampledEvent}


def test_virtual_batches_split_the_padding_with_the_rows():
    """A padded batch split into physical chunks clips the same examples as whole."""
    whole, split = _private(sigma=1e-9), _private(sigma=1e-9, max_physical_batch_size=25)
    results = []
    for private in (whole, split):
        for x, y in private.loader:
            nn.functional.cross_entropy(private.model(x), y, reduction="mean").backward()
            private.optimizer.step()
            private.optimizer.zero_grad()
            if private.optimizer.boundary.closes_batch:
                break
        assert private.ledger.steps == 1
        results.append([p.detach().clone() for p in private.model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The accounting
# ---------------------------------------------------------------------------------------------
def _truncated_run(n, q, cap, sigma, steps):
    return SelfComposedEvent(TruncatedPoissonSampledEvent(q, n, cap, GaussianEvent(sigma)), steps)


def test_truncation_probability_is_the_binomial_tail_of_the_larger_neighbour():
    n, q, cap = 1000, 0.05, 60
    direct = sum(math.comb(n + 1, k) * q**k * (1 - q) ** (n + 1 - k) for k in range(cap + 1, n + 2))
    assert truncation_probability(n, q, cap) == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize(
    ("n", "batch", "sigma", "steps", "cap"),
    [(60000, 256, 1.0, 2000, 383), (10000, 100, 0.8, 500, 176), (5000, 50, 1.2, 300, 104)],
)
def test_truncated_epsilon_matches_an_independent_computation(n, batch, sigma, steps, cap):
    """ε = the smallest ε with δ_Poisson(ε) + (1 + e^ε)·T·P[Bin(N+1, q) > M] ≤ δ, where
    δ_Poisson comes from dp_accounting; and never below dp_accounting's mixture ε."""
    q, delta = batch / n, 1e-6
    ours = make_accountant("pld").compose(_truncated_run(n, q, cap, sigma, steps)).epsilon(delta)
    slack = steps * float(stats.binom.sf(cap, n + 1, q))
    reference = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    reference.compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    )

    def excess(eps: float) -> float:
        return reference.get_delta(eps) + (1 + math.exp(eps)) * slack - delta

    top = math.log(delta / (2 * slack) - 1)  # where the cut alone spends δ/2
    independent = optimize.brentq(excess, 1e-3, top, xtol=1e-10)
    assert ours == pytest.approx(independent, rel=1e-2)
    mixture = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    mixture.compose(
        dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(n, q, cap, sigma), steps)
    )
    assert ours >= mixture.get_epsilon(delta) * (1 - 1e-2)


def test_a_frequent_cut_is_charged_not_ignored():
    """The cut's chance enters δ: a cap that cuts often costs more than Poisson, up to ∞."""
    n, q, sigma, steps, delta = 60000, 256 / 60000, 1.0, 2000, 1e-6
    poisson = make_accountant("pld").compose(
        SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(sigma)), steps)
    )
    at = {
        cap: make_accountant("pld").compose(_truncated_run(n, q, cap, sigma, steps))
        for cap in (300, 372, 420)
    }
    assert at[300].epsilon(delta) == math.inf
    assert at[372].epsilon(delta) > poisson.epsilon(delta)
    assert at[420].epsilon(delta) == pytest.approx(poisson.epsilon(delta), rel=1e-6)
    eps = 1.0
    slack = steps * truncation_probability(n, q, 372)
    assert at[372].delta(eps) == pytest.approx(poisson.delta(eps) + (1 + math.e) * slack)


def test_suggested_cap_keeps_the_cut_below_its_budget():
    n, q, steps = 60000, 256 / 60000, 2000
    cap = max_batch_size_for(n, q, steps, budget=1e-10)
    assert steps * truncation_probability(n, q, cap) <= 1e-10
    assert steps * truncation_probability(n, q, cap - 1) > 1e-10


def _request(**changes) -> PlanRequest:
    settings = dict(
        records=60000, batch_size=256, delta=1e-6, max_grad_norm=1.0, epochs=2,
        target_epsilon=3.0, sampler="truncated-poisson", max_batch_size=400,
    )  # fmt: skip
    settings.update(changes)
    return PlanRequest(**settings)


def test_plan_calibrates_sigma_on_the_truncated_events():
    plan = make_plan(_request())
    record = plan.sampling_record()
    assert record == SamplingRecord(SamplingKind.TRUNCATED_POISSON, 256 / 60000, 60000, 400)
    assert plan.max_batch_size == 400
    eps = (
        make_accountant("pld")
        .compose(SelfComposedEvent(record.event(plan.noise_multiplier), plan.steps))
        .epsilon(1e-6)
    )
    assert eps <= 3.0 and eps == pytest.approx(3.0, rel=1e-2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_batch_size": 300}, "cuts a batch too often.*at least"),
        ({"max_batch_size": None}, "needs max_batch_size"),
        ({"max_batch_size": 100}, "between the expected batch size"),
        ({"accountant": "rdp"}, "PLD accountant"),
        ({"microbatch_size": 4}, "microbatch_size not supported"),
        ({"sampler": "poisson"}, "pass sampler='truncated-poisson'"),
    ],
)
def test_misuse_is_refused_before_training_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        make_plan(_request(**changes))


def test_cli_names_every_sampler_and_asks_truncated_poisson_for_its_cap(tmp_path):
    from dpfy.jobs.config import SAMPLER_NAMES

    assert {"poisson", "truncated-poisson", "balls-in-bins", "shuffle"} <= set(SAMPLER_NAMES)
    from typer.testing import CliRunner

    from dpfy.cli.app import app

    done = CliRunner().invoke(app, ["train", "--dataset", "digits", "--epochs", "1",
                                    "--sampler", "truncated-poisson",
                                    "--out", str(tmp_path / "run")])  # fmt: skip
    assert done.exit_code == 2
    assert "needs max_batch_size=M" in done.stderr and "M = " in done.stderr


def _steps(private, count: int) -> list[int]:
    """Take ``count`` steps; the examples (not rows) of each batch."""
    seen = []
    for x, y in private.loader:
        nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
        private.optimizer.zero_grad()
        seen.append(private.loader.provenance.current.padding.real)
        if len(seen) == count:
            break
    return seen


def test_a_resumed_run_draws_the_same_padded_batches_and_spends_the_same(tmp_path):
    whole = _private()
    _steps(whole, 3)
    whole.save(tmp_path / "checkpoint.pt")
    rest = _steps(whole, 3)
    resumed = _private()
    resumed.load(tmp_path / "checkpoint.pt")
    assert _steps(resumed, 3) == rest
    assert resumed.ledger.epsilon() == whole.ledger.epsilon()


def test_an_all_padding_batch_sums_to_exactly_zero_and_counts_nothing():
    """An empty truncated-Poisson batch is M padding rows: a step of noise only."""
    model = _model()
    engine = make_engine(model, "fast")
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    nn.functional.cross_entropy(model(x), y).backward()
    result = engine.clip_and_accumulate(1.0, "mean", padding=Padding(4, 0))
    assert result.num_examples == 0 and result.norms.numel() == 0
    assert all(not bool(t.any()) for t in engine.summed_grads().values())
    engine.detach()


def test_a_non_finite_padding_row_is_refused_not_summed():
    """0 × NaN is NaN: a padding row whose gradient is not finite refuses the step."""
    model = _model()
    engine = make_engine(model, "fast")
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    x[3] = float("nan")
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="padding row"):
        engine.clip_and_accumulate(1.0, "mean", padding=Padding(4, 3))
    engine.detach()
