"""DP-FedAvg / DP-FedSGD: guide alg. 2 step by step, its noise, its accounting, bad input."""

from __future__ import annotations

import copy
import json
import logging
import math

import dp_accounting as dpa
import pytest
import torch
from dp_accounting import pld as dpa_pld
from dp_accounting import rdp as dpa_rdp
from torch import nn
from torch.utils.data import TensorDataset

from dpfy.federated import (
    DPFedAvg,
    FedAvgConfig,
    calibrate_user_noise,
    clip_update,
    make_server_optimizer,
    simulate,
)
from dpfy.plan.accounting import PldAccountant, RdpAccountant, dpsgd_event
from dpfy.train.ledger import BudgetExhausted, PrivacyLedger

DELTA = 1e-5


class PatternNoise:
    """A deterministic noise source: std times a fixed pattern; remembers the std it was asked."""

    def __init__(self) -> None:
        self.stds: list[float] = []

    @staticmethod
    def pattern(like: torch.Tensor) -> torch.Tensor:
        return torch.linspace(-1.0, 1.0, like.numel(), dtype=like.dtype).reshape(like.shape)

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        self.stds.append(std)
        return std * self.pattern(like)


def make_users(count: int, sizes: list[int] | None = None, features: int = 3, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    sizes = sizes or [4] * count
    users = []
    for n in sizes:
        x = torch.randn(n, features, generator=generator)
        y = torch.randint(0, 2, (n,), generator=generator)
        users.append(TensorDataset(x, y))
    return users


def tiny_model(seed: int = 0, features: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(features, 2)


def ledger(target: float | None = None, accountant: str = "pld") -> PrivacyLedger:
    return PrivacyLedger(DELTA, accountant=accountant, target_epsilon=target)


# -- accounting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_accounting_is_the_dpsgd_event_at_q_equal_bc_over_users(accountant):
    users, bc, sigma, rounds = 20, 5, 1.3, 6
    book = ledger(accountant=accountant)
    trainer = DPFedAvg(
        tiny_model(), make_users(users), FedAvgConfig(bc, sigma, 1.0), book, rounds=rounds, seed=1
    )
    for _ in range(rounds):
        trainer.round()
    q = bc / users
    core = (PldAccountant() if accountant == "pld" else RdpAccountant()).compose(
        dpsgd_event(q, sigma, rounds)
    )
    assert book.epsilon() == pytest.approx(core.epsilon(DELTA), rel=1e-9)
    assert book.summary().sampling[0].sampling.sampling_rate == pytest.approx(q)
    assert book.summary().sampling[0].sampling.dataset_size == users
    oracle_event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), rounds
    )
    if accountant == "pld":
        oracle = dpa_pld.PLDAccountant(value_discretization_interval=1e-3)
    else:
        oracle = dpa_rdp.RdpAccountant()
    oracle.compose(oracle_event)
    tolerance = 1e-3 if accountant == "pld" else 0.02  # RDP: the two order grids differ
    assert book.epsilon() == pytest.approx(oracle.get_epsilon(DELTA), rel=tolerance)
    assert book.summary().sampling[0].sampling.unit == "user"


def test_calibrated_sigma_meets_the_user_level_target():
    sigma = calibrate_user_noise(2.0, DELTA, 100, 10, 50)
    spent = PldAccountant().compose(dpsgd_event(0.1, sigma, 50)).epsilon(DELTA)
    assert 1.9 < spent <= 2.0
    assert PldAccountant().compose(dpsgd_event(0.1, sigma * 0.97, 50)).epsilon(DELTA) > 2.0


# -- guide alg. 2, step by step -----------------------------------------------------------------
def _manual_local(theta: nn.Module, data: TensorDataset, steps: int, lr: float) -> nn.Module:
    local = copy.deepcopy(theta)
    x, y = data.tensors
    for _ in range(steps):
        local.zero_grad()
        nn.functional.cross_entropy(local(x), y).backward()
        with torch.no_grad():
            for p in local.parameters():
                p -= lr * p.grad
    return local


def test_one_round_reproduces_guide_algorithm_2():
    users = make_users(8, sizes=[3, 5, 2, 6, 4, 7, 1, 5])
    bc, sigma, clip, steps, eta_c, eta_s = 3, 0.7, 0.05, 2, 0.5, 0.8
    config = FedAvgConfig(bc, sigma, clip, local_steps=steps, client_lr=eta_c, server_lr=eta_s)
    model = tiny_model()
    theta = copy.deepcopy(model)
    noise = PatternNoise()
    seed = next(  # a seed whose first round samples a count other than B_c: ÷ B_c is visible
        s
        for s in range(100)
        if len(DPFedAvg(tiny_model(), users, config, ledger(), rounds=1, seed=s)._next_users())
        not in (0, bc)
    )
    trainer = DPFedAvg(model, users, config, ledger(), rounds=1, seed=seed, noise=noise)
    result = trainer.round()
    assert len(result.sampled) not in (0, bc)

    expected = {n: torch.zeros_like(p) for n, p in theta.named_parameters()}
    norms = []
    for user in result.sampled:
        local = _manual_local(theta, users[user], steps, eta_c)
        delta = {
            n: p.detach() - dict(theta.named_parameters())[n].detach()
            for n, p in local.named_parameters()
        }
        norm = math.sqrt(sum(float((d**2).sum()) for d in delta.values()))
        norms.append(norm)
        for n in expected:
            expected[n] += delta[n] * min(1.0, clip / norm)
    assert max(norms) > clip  # the clipping was exercised
    assert result.update_norms == pytest.approx(norms, rel=1e-5)
    # noise σC on the sum, drawn at the divisor's scale: σC/B_c on the sum ÷ B_c
    assert noise.stds == [pytest.approx(sigma * clip / bc)] * len(expected)
    for name, param in theta.named_parameters():
        noisy_mean = (expected[name] + sigma * clip * PatternNoise.pattern(param)) / bc
        assert torch.allclose(
            dict(model.named_parameters())[name], param + eta_s * noisy_mean, atol=1e-6
        )


def test_fedsgd_is_one_full_batch_gradient_step_per_user():
    users = make_users(1, sizes=[6])
    config = FedAvgConfig.fedsgd(1, 1.0, clip_norm=1e6, server_lr=0.3)
    assert config.algorithm == "DP-FedSGD"
    model = tiny_model()
    theta = copy.deepcopy(model)

    class Zero(PatternNoise):
        def normal(self, like, std):
            return torch.zeros_like(like)

    DPFedAvg(model, users, config, ledger(), rounds=1, seed=0, noise=Zero()).round()
    x, y = users[0].tensors
    nn.functional.cross_entropy(theta(x), y).backward()
    for (name, p), q in zip(theta.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(q, p - 0.3 * p.grad, atol=1e-6), name


def test_noise_on_the_update_has_std_sigma_c_over_bc():
    """Users whose change is zero: the server step is noise only, N(0, (σC/B_c)²) per coordinate."""
    sigma, clip, bc, eta_s = 2.0, 0.5, 4, 1.0
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    before = copy.deepcopy(model)
    users = make_users(8, features=100)
    trainer = DPFedAvg(
        model,
        users,
        FedAvgConfig(bc, sigma, clip, server_lr=eta_s),
        ledger(),
        rounds=1,
        seed=3,
        loss_fn=lambda out, y: 0.0 * out.sum(),
    )
    trainer.round()
    pairs = zip(model.parameters(), before.parameters(), strict=True)
    change = torch.cat([(a - b).flatten() for a, b in pairs])
    expected = sigma * clip / bc
    n = change.numel()  # 10 100 coordinates: the sample std is within ~1.4% at 2 s.e.
    assert change.std().item() == pytest.approx(expected, rel=4 * math.sqrt(0.5 / n) + 0.01)
    assert abs(change.mean().item()) < 5 * expected / math.sqrt(n)


def test_an_empty_round_still_adds_noise_and_is_accounted():
    users = make_users(50)
    book = ledger()
    model = tiny_model()
    trainer = DPFedAvg(model, users, FedAvgConfig(1, 1.0, 1.0), book, rounds=40, seed=0)
    for _ in range(40):
        before = copy.deepcopy(model.state_dict())
        result = trainer.round()
        if not result.sampled:
            break
    else:
        pytest.fail("no empty round in 40 draws at q = 0.02")
    assert book.steps == result.round
    assert not torch.equal(before["weight"], model.weight)


def test_clip_update_scales_only_long_changes():
    delta = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped, norm = clip_update(delta, 1.0)
    assert norm == pytest.approx(5.0)
    assert torch.allclose(clipped["a"], torch.tensor([0.6, 0.0]))
    short, _ = clip_update(delta, 10.0)
    assert torch.equal(short["b"], delta["b"])


def test_an_update_that_overflows_the_model_dtype_is_dropped_not_summed_as_nan():
    # Finite in float64, infinite once cast to the model's float32: it must not reach the sum.
    from dpfy.federated import ClippedSum, MalformedUpdate
    from dpfy.train.noise.source import TorchNoise
    from dpfy.train.private_aggregation import PrivateAggregation

    aggregation = PrivateAggregation.gaussian(frozenset("w"), TorchNoise(0), 1.0, 1.0, 2)
    total = ClippedSum({"w": torch.zeros(2)}, 1.0, aggregation)
    opened = total.total["w"].clone()
    with pytest.raises(MalformedUpdate, match="not finite"):
        total.add({"w": torch.tensor([1e300, 0.0], dtype=torch.float64)})
    assert total.accepted == 0 and torch.equal(total.total["w"], opened)


# -- the model: frozen parameters, batch norm ---------------------------------------------------
def test_frozen_parameters_are_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    frozen = copy.deepcopy(model[0].state_dict())
    trained = model[2].weight.detach().clone()
    trainer = DPFedAvg(model, make_users(6), FedAvgConfig(3, 1.0, 1.0), ledger(), rounds=3, seed=0)
    for _ in range(3):
        trainer.round()
    assert torch.equal(model[0].weight, frozen["weight"])
    assert torch.equal(model[0].bias, frozen["bias"])
    assert not torch.equal(model[2].weight, trained)


def test_batch_norm_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="BatchNorm1d"):
        DPFedAvg(model, make_users(4), FedAvgConfig(2, 1.0, 1.0), ledger(), rounds=1)


# -- bad input ----------------------------------------------------------------------------------
def test_users_without_data_are_refused():
    users = make_users(5)
    users[3] = TensorDataset(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"1 user\(s\) have no data \(users 3\)"):
        DPFedAvg(tiny_model(), users, FedAvgConfig(2, 1.0, 1.0), ledger(), rounds=1)


def test_more_clients_per_round_than_users_is_refused():
    with pytest.raises(ValueError, match="clients_per_round 6 exceeds the 5 users"):
        DPFedAvg(tiny_model(), make_users(5), FedAvgConfig(6, 1.0, 1.0), ledger(), rounds=1)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"clients_per_round": 0}, "clients_per_round"),
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"local_steps": 0}, "local_steps"),
        ({"client_lr": float("nan")}, "client_lr"),
    ],
)
def test_bad_config_is_refused(kwargs, name):
    base = {"clients_per_round": 2, "noise_multiplier": 1.0, "clip_norm": 1.0}
    with pytest.raises(ValueError, match=name):
        FedAvgConfig(**{**base, **kwargs})


def test_unknown_server_optimizer_and_foreign_tensors_are_refused():
    with pytest.raises(ValueError, match="sgd, momentum, adam"):
        make_server_optimizer("lbfgs-ish", [nn.Parameter(torch.zeros(1))], 1.0)
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(ValueError, match="not trainable parameters of the model"):
        DPFedAvg(
            tiny_model(),
            make_users(4),
            FedAvgConfig(2, 1.0, 1.0),
            ledger(),
            rounds=1,
            server_optimizer=foreign,
        )


def test_a_diverged_user_is_dropped_logged_and_the_round_still_accounted(caplog):
    users = make_users(4)
    users[1] = TensorDataset(torch.full((4, 3), float("nan")), torch.zeros(4, dtype=torch.long))
    config = FedAvgConfig(4, 1.0, 1.0)  # q = 1: every user every round
    book = ledger()
    model = tiny_model()
    with caplog.at_level(logging.WARNING, logger="dpfy.federated"):
        result = DPFedAvg(model, users, config, book, rounds=1, seed=0).round()
    assert result.dropped == (1,) and result.accepted == 3
    assert "user 1 dropped" in caplog.text
    assert book.steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_delta_not_below_one_over_n_users_warns():
    # δ ≥ 1/N_users is met by publishing one random user's data outright (guide §2.1).
    with pytest.warns(UserWarning, match=r"1/N_users = 0\.25"):
        DPFedAvg(tiny_model(), make_users(4), FedAvgConfig(2, 1.0, 1.0), PrivacyLedger(0.3),
                 rounds=1)  # fmt: skip


# -- budget and reproducibility -----------------------------------------------------------------
def test_budget_spent_mid_run_stops_before_the_round_is_applied():
    users, bc, sigma = 10, 5, 0.8
    probe = ledger()
    one = DPFedAvg(
        tiny_model(), make_users(users), FedAvgConfig(bc, sigma, 1.0), probe, rounds=1, seed=0
    )
    one.round()
    target = PldAccountant().compose(dpsgd_event(bc / users, sigma, 3)).epsilon(DELTA) * 1.0001
    book = ledger(target)
    model = tiny_model()
    trainer = DPFedAvg(
        model, make_users(users), FedAvgConfig(bc, sigma, 1.0), book, rounds=10, seed=0
    )
    result = simulate(trainer, 10, progress=False)
    assert result.rounds == 3 and book.steps == 3
    assert result.stopped is not None and "budget exhausted" in result.stopped
    assert book.epsilon() <= target
    snapshot = copy.deepcopy(model.state_dict())
    with pytest.raises(BudgetExhausted):
        trainer.round()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items())
    assert book.steps == 3


def test_same_seed_same_run():
    def run(seed: int) -> torch.Tensor:
        model = tiny_model()
        config = FedAvgConfig(3, 1.0, 1.0, local_steps=3, local_batch_size=2)
        trainer = DPFedAvg(model, make_users(6), config, ledger(), rounds=4, seed=seed)
        simulate(trainer, 4, progress=False)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


def test_server_adam_is_post_processing_with_the_same_accounting():
    book_sgd, book_adam = ledger(), ledger()
    for book, name in ((book_sgd, "sgd"), (book_adam, "adam")):
        config = FedAvgConfig(3, 1.0, 1.0, server_optimizer=name, server_lr=0.1)
        trainer = DPFedAvg(tiny_model(), make_users(6), config, book, rounds=2, seed=0)
        simulate(trainer, 2, progress=False)
    assert book_adam.epsilon() == book_sgd.epsilon()


# -- the command ----------------------------------------------------------------------------------
def _dpfy(*args: str):
    """The command in process (typer's runner): the exit code and stderr as a shell sees them."""
    from typer.testing import CliRunner

    from dpfy.cli.app import app

    return CliRunner().invoke(app, list(args))


def test_dpfy_federated_writes_a_user_level_report(tmp_path):
    out = tmp_path / "run"
    run = _dpfy(
        "federated",
        "--users",
        "20",
        "--clients-per-round",
        "5",
        "--rounds",
        "3",
        "--model",
        "logreg",
        "--local-steps",
        "2",
        "--target-epsilon",
        "6",
        "--out",
        str(out),
    )
    assert run.exit_code == 0, run.output
    facts = json.loads((out / "facts.json").read_text())
    assert facts["training"]["unit"] == "user" and facts["privacy"]["unit"] == "user"
    assert facts["privacy"]["dataset_size"] == 20 and facts["privacy"]["algorithm"] == "dp-fedavg"
    assert facts["accounting"]["summary"]["steps"] == 3
    assert facts["accounting"]["summary"]["epsilon"]["total"] <= 6.0
    card = json.loads((out / "report.json").read_text())
    assert card["unit_of_privacy"]["unit"] == "user"
    assert "trusted aggregator" in card["dp_setting"]["statement"]
    assert "DP-FedAvg" in card["unit_of_privacy"]["statement"]
    assert "one user (all of that user's examples)" in card["neighbouring_relation"]["statement"]
    assert "model change after local training" in card["assumptions"]["clipping"]["statement"]
    assert "every user joined each step" in card["assumptions"]["sampling"]["statement"]
    assert "sum of clipped user model changes" in card["accounting"]["statement"]
    assert "user-level" in (out / "report.md").read_text()


def test_dpfy_federated_refuses_more_clients_than_users_in_one_line(tmp_path):
    run = _dpfy(
        "federated", "--users", "20", "--clients-per-round", "50", "--out", str(tmp_path / "x")
    )
    assert run.exit_code == 2
    assert run.stderr.strip().startswith("error:") and "exceeds --users 20" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("--clients-per-round", "0", "clients_per_round"),
        ("--local-steps", "0", "local_steps"),
        ("--local-batch-size", "-1", "local_batch_size"),  # 0: all of a user's data
        ("--client-lr", "-1", "client_lr"),
        ("--server-lr", "0", "server_lr"),
        ("--clip-norm", "0", "clip_norm"),
        ("--server-optimizer", "rmsprop", "--server-optimizer"),
    ],
)
def test_dpfy_federated_refuses_bad_settings_before_creating_the_run_dir(
    tmp_path, option, value, named
):
    run = _dpfy("federated", "--users", "20", option, value, "--out", str(tmp_path / "x"))
    assert run.exit_code == 2, run.output
    assert named in run.stderr
    assert not (tmp_path / "x").exists()


def test_the_cli_knows_exactly_the_registered_server_optimizers():
    from dpfy.federated import SERVER_OPTIMIZERS
    from dpfy.federated.config import SERVER_OPTIMIZER_NAMES

    assert set(SERVER_OPTIMIZER_NAMES) == set(SERVER_OPTIMIZERS)
