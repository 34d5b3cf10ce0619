"""User-level DP-SGD: per-user clipping against one-user references; noise, ledger, bad input."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy import stats
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import dpfy
from dpfy.cli.app import app
from dpfy.data.loader import rest_of_run
from dpfy.data.user_sampling import UserDataLoader, UserPoissonSampler, check_user_ids
from dpfy.plan.accounting import PldAccountant, dpsgd_event
from dpfy.plan.accounting.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from dpfy.plan.group_privacy import group_privacy
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.report.facts import collect_facts
from dpfy.report.render import build_report
from dpfy.train.grads import make_engine
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.step_record import StepRecord

# -- the engine's grouped clipping against a batch-of-one-user reference --------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()


def cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.GroupNorm(1, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 3),
    ).double()


class MeanOverPositions(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(1)


def sequence_model() -> nn.Module:
    """Embedding and a Linear on (B, T, d): the ghost-norm and sequence routes of the rules."""
    torch.manual_seed(2)
    return nn.Sequential(
        nn.Embedding(11, 32), nn.Linear(32, 40), nn.Tanh(), MeanOverPositions(), nn.Linear(40, 3)
    ).double()


def inputs_for(model: nn.Module, n: int) -> Tensor:
    generator = torch.Generator().manual_seed(7)
    if isinstance(model[0], nn.Embedding):
        return torch.randint(0, 11, (n, 5), generator=generator)
    shape = (n, 1, 5, 5) if isinstance(model[0], nn.Conv2d) else (n, 6)
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def per_example_losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def user_reference(
    model: nn.Module, x: Tensor, y: Tensor, users: Tensor, clip: float
) -> tuple[dict[str, Tensor], Tensor]:
    """Σ_u clip(∇ mean_{i∈u} ℓᵢ), one plain backward per user on that user's data alone."""
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for user in torch.unique(users):  # sorted, as the engine numbers its units
        mine = users == user
        model.zero_grad()
        per_example_losses(model, x[mine], y[mine]).mean().backward()
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
        norms.append(norm)
        factor = min(1.0, clip / float(norm))
        for n in params:
            total[n] += factor * grads[n]
    model.zero_grad()
    return total, torch.stack(norms)


def engine_user_sum(
    model: nn.Module, kind: str, x: Tensor, y: Tensor, users: Tensor, clip: float, reduction: str
) -> tuple[dict[str, Tensor], Tensor, int]:
    engine = make_engine(model, kind)
    try:
        losses = per_example_losses(model, x, y)
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
        result = engine.clip_and_accumulate(clip, reduction, groups=users)
        return engine.summed_grads(), result.norms, result.num_units
    finally:
        engine.detach()


# Users interleaved (not consecutive), of sizes 4, 1, 3 and 2, with ids that are not 0..U-1.
USERS = torch.tensor([7, 2, 7, 9, 2, 2, 7, 11, 9, 7])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["fast", "vmap"])
@pytest.mark.parametrize(
    "build", [mlp, cnn, sequence_model], ids=["mlp-layernorm", "cnn-groupnorm", "sequence"]
)
def test_per_user_clipped_sum_equals_batch_of_one_user_reference(
    build: Callable[[], nn.Module], kind: str, reduction: str
):
    model = build()
    x = inputs_for(model, len(USERS))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    _, free = user_reference(model, x, y, USERS, math.inf)
    middle = free.sort().values[1:3]
    clip = float(middle.mean())  # two users clipped, two not
    expected, ref_norms = user_reference(model, x, y, USERS, clip)
    sums, norms, units = engine_user_sum(model, kind, x, y, USERS, clip, reduction)
    assert units == 4
    assert bool((ref_norms > clip).any()) and bool((ref_norms < clip).any())
    torch.testing.assert_close(norms, ref_norms, rtol=1e-7, atol=1e-10)
    for name, value in expected.items():
        torch.testing.assert_close(sums[name], value, rtol=1e-7, atol=1e-10, msg=name)


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_a_user_with_many_examples_contributes_at_most_c(kind: str):
    """One user with 40 (identical) examples: norm C, where example-level clipping gives 40C."""
    model = mlp()
    x = inputs_for(model, 1).repeat(40, 1)
    y = torch.ones(40, dtype=torch.int64)
    clip = 1e-3
    one_user = torch.zeros(40, dtype=torch.int64)
    sums, norms, _ = engine_user_sum(model, kind, x, y, one_user, clip, "mean")
    total = torch.sqrt(sum(v.square().sum() for v in sums.values()))
    assert float(norms[0]) > clip
    assert float(total) == pytest.approx(clip, rel=1e-9)
    each = torch.arange(40)  # every example its own unit: example-level clipping
    sums, _, _ = engine_user_sum(model, kind, x, y, each, clip, "mean")
    example_level = float(torch.sqrt(sum(v.square().sum() for v in sums.values())))
    assert example_level == pytest.approx(40 * clip, rel=1e-9)


def test_groups_bad_input_is_refused_and_the_sum_is_kept():
    model = mlp()
    engine = make_engine(model, "fast")
    x, y = inputs_for(model, 4), torch.tensor([0, 1, 2, 0])
    try:
        per_example_losses(model, x, y).mean().backward()
        engine.clip_and_accumulate(1.0, groups=torch.tensor([0, 0, 1, 1]))
        kept = {n: v.clone() for n, v in engine.summed_grads().items()}
        for groups, message in [
            (torch.tensor([0, 1, 1]), "groups has 3 ids but the batch has 4"),
            (torch.tensor([0.0, 1, 1, 1]), "integer"),
            (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
        ]:
            per_example_losses(model, x, y).mean().backward()
            with pytest.raises(ValueError, match=message):
                engine.clip_and_accumulate(1.0, groups=groups)
        with pytest.raises(ValueError, match="not both"):
            engine.clip_and_accumulate(1.0, microbatch_size=2, groups=torch.tensor([0, 0, 1, 1]))
        for name, value in engine.summed_grads().items():
            torch.testing.assert_close(value, kept[name])
    finally:
        engine.detach()


# -- make_private(user_ids=...) -------------------------------------------------------------------


def user_data(n: int = 300, users: int = 30, seed: int = 0) -> tuple[TensorDataset, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=generator)
    y = torch.randint(0, 3, (n,), generator=generator)
    ids = torch.cat(
        [torch.arange(users), torch.randint(0, users, (n - users,), generator=generator)]
    )
    return TensorDataset(x, y), ids


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))


class ZeroGradientModel(nn.Module):
    """Its loss ignores the parameters' values: every gradient is exactly zero (noise only)."""

    def __init__(self, size: int = 4000) -> None:
        super().__init__()
        self.linear = nn.Linear(size // 2, 2, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * 0.0


def flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run(private: dpfy.PrivateTraining, criterion: nn.Module | None = None) -> int:
    criterion = criterion or nn.CrossEntropyLoss()
    taken = 0
    for x, y in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        criterion(private.model(x), y).backward()
        private.optimizer.step()
        taken += 1
    return taken


def test_update_is_the_sum_of_clipped_user_means_over_expected_users():
    """Negligible noise: θ' = θ − lr · Σ_u clip(mean gradient of u) / B_users (rule 1, per user)."""
    data, ids = user_data()
    model, reference = small_mlp(), small_mlp()
    clip, users_per_step = 0.05, 6
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), data, batch_size=users_per_step,
        steps=1, noise_multiplier=1e-12, delta=1e-5, max_grad_norm=clip, user_ids=ids,
        max_examples_per_user=4, seed=2,
    )  # fmt: skip
    for x, y in rest_of_run(private.loader):
        batch_users = private.loader.provenance.current.units.clone()
        private.optimizer.zero_grad()
        nn.CrossEntropyLoss()(private.model(x), y).backward()
        private.optimizer.step()
    assert torch.unique(batch_users).numel() != users_per_step  # Poisson: realised ≠ expected
    assert int(torch.bincount(batch_users).max()) <= 4  # the cap
    total = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for user in torch.unique(batch_users):
        mine = batch_users == user
        reference.zero_grad()
        nn.CrossEntropyLoss()(reference(x[mine]), y[mine]).backward()
        grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        norm = float(torch.sqrt(sum(g.square().sum() for g in grads.values())))
        for n in total:
            total[n] += min(1.0, clip / norm) * grads[n]
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        expected = r.detach() - total[name] / users_per_step
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7, msg=name)


def test_noise_std_is_sigma_c_per_coordinate_divided_by_expected_users():
    """Zero gradients: one step moves each coordinate by lr·N(0, σ²C²)/B_users (chi-square)."""
    model = ZeroGradientModel()
    n = 200
    data = TensorDataset(torch.randn(n, 2000), torch.zeros(n))
    ids = torch.arange(n) % 50
    lr, sigma, clip, users_per_step = 0.5, 1.3, 0.7, 10
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=lr), data, batch_size=users_per_step,
        steps=1, noise_multiplier=sigma, delta=1e-5, max_grad_norm=clip, user_ids=ids, seed=3,
    )  # fmt: skip
    before = flat(model)
    for x, _ in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        private.model(x).sum().backward()
        private.optimizer.step()
    update = (flat(model) - before).double().numpy()
    expected_var = (lr * sigma * clip / users_per_step) ** 2
    statistic = float(np.sum(update**2) / expected_var)
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], update.size)
    assert lo < statistic < hi
    # the example-level sensitivity (2C for microbatches) is not used: 4× the variance fails
    assert not lo < statistic / 4 < hi


def test_ledger_accounts_poisson_sampled_users_at_b_users_over_n_users():
    data, ids = user_data(users=40)
    model = small_mlp()
    sigma, steps = 1.1, 7
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=8, steps=steps,
        noise_multiplier=sigma, delta=1e-5, max_grad_norm=1.0, user_ids=ids, seed=0,
    )  # fmt: skip
    assert run(private) == steps
    q = 8 / 40
    events = private.ledger.events().events
    assert events == (SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(sigma)), steps),)
    [sampled] = private.ledger.summary().sampling
    assert sampled.sampling.unit == "user" and sampled.sampling.dataset_size == 40
    expected = PldAccountant().compose(dpsgd_event(q, sigma, steps)).epsilon(1e-5)
    assert private.epsilon() == pytest.approx(expected, rel=1e-6)
    assert private.plan.unit == "user" and private.plan.dataset_size == 40
    assert private.plan.examples == len(data)


def test_calibrated_user_level_run_meets_the_target_and_resumes(tmp_path):
    data, ids = user_data(users=30)

    def build(seed: int = 4) -> dpfy.PrivateTraining:
        model = small_mlp()
        return dpfy.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=6, epochs=2,
            target_epsilon=2.0, delta=1e-4, max_grad_norm=1.0, user_ids=ids,
            max_examples_per_user=5, seed=seed,
        )  # fmt: skip

    class NoNoise:
        def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
            return torch.zeros_like(like)

    whole = build()
    criterion = nn.CrossEntropyLoss()
    for taken, (x, y) in enumerate(whole.loader, start=1):
        whole.optimizer.zero_grad()
        criterion(whole.model(x), y).backward()
        whole.optimizer.step()
        if taken == 4:
            break
    whole.save(tmp_path / "ckpt.pt")
    # A resume draws fresh noise (replaying the stream would let two continuations cancel it):
    # with the noise after the checkpoint silenced on both sides, the rest is exact.
    whole.optimizer.noise = NoNoise()
    run(whole)
    assert whole.epsilon() <= 2.0
    resumed = build(seed=99)
    resumed.load(tmp_path / "ckpt.pt")
    resumed.optimizer.noise = NoNoise()
    run(resumed)
    assert resumed.ledger.steps == whole.ledger.steps
    torch.testing.assert_close(flat(resumed.model), flat(whole.model))


# -- the sampler ----------------------------------------------------------------------------------


def test_sampler_draws_users_by_poisson_and_caps_their_examples_uniformly():
    ids = torch.arange(2000) % 100  # 100 users × 20 examples
    q, cap, steps = 0.1, 3, 400
    sampler = UserPoissonSampler(
        ids, q, steps, torch.Generator().manual_seed(0), max_examples_per_user=cap
    )
    counts, drawn = [], torch.zeros(2000)
    for batch in sampler:
        users = ids[batch]
        assert bool((torch.bincount(users)[torch.unique(users)] == cap).all())
        counts.append(torch.unique(users).numel())
        drawn[batch] += 1
    # users per step ~ Binomial(100, q): mean and variance
    assert np.mean(counts) == pytest.approx(100 * q, abs=4 * math.sqrt(100 * q * (1 - q) / steps))
    assert np.var(counts) == pytest.approx(100 * q * (1 - q), rel=0.3)
    # each example of a sampled user is used with probability cap / 20: uniform within users
    rate = drawn / steps
    assert float(rate.mean()) == pytest.approx(q * cap / 20, rel=0.05)
    assert stats.chisquare(drawn.numpy()).pvalue > 1e-4
    assert sampler.record == SamplingRecord(SamplingKind.POISSON, q, 100, unit="user")


def test_sampling_record_round_trips_with_its_unit_and_ledger_refuses_mixed_units():
    record = SamplingRecord(SamplingKind.POISSON, 0.2, 50, unit="user")
    assert SamplingRecord.from_dict(record.to_dict()) == record
    assert "unit" not in SamplingRecord(SamplingKind.POISSON, 0.2, 50).to_dict()
    assert "users" in record.description
    ledger = PrivacyLedger(1e-5)
    ledger.record(StepRecord(record, 1.0))
    with pytest.raises(ValueError, match="unit of privacy mismatch"):
        ledger.record(StepRecord(SamplingRecord(SamplingKind.POISSON, 0.2, 50), 1.0))
    with pytest.raises(ValueError, match="sampling unit"):
        SamplingRecord(SamplingKind.POISSON, 0.2, 50, unit="household")


# -- bad input ------------------------------------------------------------------------------------


def make(**overrides: object) -> dpfy.PrivateTraining:
    data, ids = user_data()
    model = small_mlp()
    arguments: dict[str, object] = dict(
        batch_size=5, steps=3, noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, user_ids=ids
    )
    arguments.update(overrides)
    return dpfy.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **arguments)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"user_ids": torch.cat([torch.zeros(150), torch.full((150,), 2)]).long()},
         r"1 user\(s\) hold no examples \(ids 1\)"),
        ({"batch_size": 31}, "batch_size 31 .* exceeds the 30 users"),
        ({"batch_size": 0}, "expected number of users per step"),
        ({"user_ids": torch.arange(299)}, "299 entries but the dataset has 300"),
        ({"user_ids": torch.arange(300) - 1}, "must be >= 0"),
        ({"user_ids": torch.zeros(300)}, "must hold integers"),
        ({"user_ids": torch.zeros(300, 1).long()}, "1-D LongTensor"),
        ({"microbatch_size": 2}, "microbatch_size not supported with user_ids"),
        ({"sampler": "shuffle"}, "sampler not supported with user_ids"),
        ({"max_physical_batch_size": 8}, "max_physical_batch_size not supported"),
        ({"user_ids": None, "max_examples_per_user": 3}, "max_examples_per_user needs user_ids"),
        ({"max_examples_per_user": 0}, "max_examples_per_user"),
    ],
)  # fmt: skip
def test_bad_user_level_input_is_refused_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


def test_delta_above_one_over_n_users_warns():
    with pytest.warns(UserWarning, match="1/N_users"):
        make(delta=0.05)  # 30 users: 1/N_users ≈ 0.033
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make(delta=0.01)  # below 1/N_users (the record is a user, not one of the 300 examples)


def test_optimizer_outside_the_user_loader_is_refused():
    private = make()
    x, y = private.loader.user_dataset.tensors
    nn.CrossEntropyLoss()(private.model(x[:4]), y[:4]).backward()
    with pytest.raises(ValueError, match=r"private\.loader"):
        private.optimizer.step()
    assert private.ledger.steps == 0


def test_check_user_ids_accepts_a_clean_numbering():
    ids = check_user_ids(torch.tensor([2, 0, 1, 1], dtype=torch.int32), 4)
    assert ids.dtype == torch.int64 and ids.tolist() == [2, 0, 1, 1]


def test_empty_user_step_is_still_a_noised_accounted_step():
    data, ids = user_data(users=30)
    loader = UserDataLoader(data, ids, 1, steps=40, generator=torch.Generator().manual_seed(1))
    sizes = [len(y) for _, y in rest_of_run(loader)]
    assert 0 in sizes and len(sizes) == 40  # q = 1/30: some steps sample nobody
    model = small_mlp()
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=1, steps=40,
        noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, user_ids=ids, seed=1,
    )  # fmt: skip
    before = flat(model)
    assert run(private) == 40 and private.ledger.steps == 40
    assert not torch.equal(before, flat(model))


# -- the report card ------------------------------------------------------------------------------


def test_report_states_user_level_with_users_and_cap():
    data, ids = user_data(users=30)
    model = small_mlp()
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=6, steps=5,
        noise_multiplier=1.0, delta=1e-4, max_grad_norm=1.0, user_ids=ids,
        max_examples_per_user=7, seed=0,
    )  # fmt: skip
    run(private)
    facts = collect_facts(private, dataset_name="synthetic", model_name="mlp")
    assert facts.training.unit == "user" and facts.dataset.size == 300
    card = build_report(facts)
    data_json, md = card.to_json(), card.to_markdown()
    unit = data_json["unit_of_privacy"]
    assert unit["unit"] == "user" and unit["users"] == 30 and unit["max_examples_per_user"] == 7
    assert "30 users hold the 300 training examples" in md and "at most 7" in md
    assert data_json["assumptions"]["clipping"]["unit"] == "user"
    assert "| users | N | 30 |" in md and "| max examples per sampled user (— = all) |  | 7 |" in md
    assert "at the user level" in card.headline
    assert not any(f.code == "user-level-claim" for f in card.findings)


# -- group privacy: what an example-level ε says about a user ------------------------------------


def test_group_privacy_chains_the_guarantee_over_a_users_examples():
    eps, delta = 0.7, 1e-6
    assert group_privacy(eps, delta, 1) == pytest.approx((eps, delta))
    assert group_privacy(eps, delta, 2) == pytest.approx((2 * eps, delta * (1 + math.exp(eps))))
    direct = delta * sum(math.exp(i * eps) for i in range(5))
    assert group_privacy(eps, delta, 5) == pytest.approx((5 * eps, direct), rel=1e-12)
    assert group_privacy(3.0, 1e-4, 77) == (231.0, 1.0)  # vacuous: no guarantee for this user
    with pytest.raises(ValueError, match="group_size"):
        group_privacy(eps, delta, 0)


# -- `dpfy train --unit user` ---------------------------------------------------------------------


def test_train_unit_user_writes_a_user_level_report(tmp_path):
    from rich.console import Console

    from dpfy.jobs.config import TrainConfig
    from dpfy.jobs.train import run_training

    config = TrainConfig(
        unit="user", users=40, batch_size=8, epochs=1, target_epsilon=4.0,
        max_examples_per_user=16, out=tmp_path / "run",
    )  # fmt: skip
    result = run_training(config, Console(file=open(os.devnull, "w")))  # noqa: SIM115
    report = json.loads((result.run_dir / "report.json").read_text())
    unit = report["unit_of_privacy"]
    assert unit["unit"] == "user" and unit["users"] == 40 and unit["max_examples_per_user"] == 16
    assert report["hyperparameters"]["expected_batch_size"] == 8
    assert "simulated users" in report["run"]["dataset"]["source"]
    assert result.delta == 1e-3  # a power of ten at least 10× below 1/N_users
    assert result.epsilon <= 4.0
    expected = (
        PldAccountant()
        .compose(
            dpsgd_event(
                8 / 40, report["accounting"]["noise_multiplier"], report["accounting"]["steps"]
            )
        )
        .epsilon(1e-3)
    )
    assert result.epsilon == pytest.approx(expected, rel=1e-6)


def test_train_unit_user_refuses_more_users_per_step_than_users():
    args = ["train", "--unit", "user", "--users", "10", "--batch-size", "20"]
    run = CliRunner().invoke(app, args)
    assert run.exit_code == 2
    assert "batch_size 20 exceeds --users 10" in run.stderr and "Traceback" not in run.stderr


def test_train_unit_user_without_a_batch_size_expects_a_fifth_of_the_users(tmp_path):
    args = ["train", "--unit", "user", "--users", "50", "--epochs", "1", "--seed", "0"]
    run = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run"), "--json"])
    assert run.exit_code in (0, 3), run.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["batch_size"] == 10
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["accounting"]["sampling_rate"] == pytest.approx(10 / 50)
