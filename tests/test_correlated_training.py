"""Training with matrix-factorisation noise (BandMF, BLT): the noise, its accounting, the run.

The mathematics is tested in test_correlated_math.py; here the torch streams, the mechanism's
own per-step events, the plan, the loop, checkpoints, the report and the CLI.
"""

from __future__ import annotations

import copy
import json
import math
import re
import warnings

import numpy as np
import pytest
import torch
from scipy import optimize, stats
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.data.provenance import BatchRefused, DrawnBatch
from dpfy.plan.accounting import make_accountant
from dpfy.plan.accounting.events import GaussianEvent, NeighbouringRelation, NoOpEvent
from dpfy.plan.correlated import (
    BandedNoise,
    BandedStrategy,
    Blt,
    BltNoise,
    CyclicPoisson,
    MinSeparation,
    correlated_accounting,
    optimise_banded,
    optimise_blt,
    toeplitz_matrix,
)
from dpfy.plan.correlated_events import (
    decode_strategy,
    encode_strategy,
    epoch_charges,
    epoch_participation,
)
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.ledger import BudgetExhausted, PrivacyLedger
from dpfy.train.ledger_codec import decode_entry, encode_entry
from dpfy.train.noise.banded import BandedMechanism
from dpfy.train.noise.blt import BltMechanism
from dpfy.train.step_record import StepRecord

ZERO_OUT = NeighbouringRelation.ZERO_OUT
ALGORITHMS = ("bandmf", "blt")
MECHANISMS = {"bandmf": BandedMechanism, "blt": BltMechanism}


# -- helpers -------------------------------------------------------------------------------------
class ZeroNoise:
    """Draws nothing: what is left of the noise is the buffers' (the correlated stream's tail)."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


class Replay:
    """Hands out given standard-normal draws, in order, times std."""

    def __init__(self, draws: list[torch.Tensor]) -> None:
        self.draws = list(draws)

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        z = self.draws.pop(0)
        assert z.shape == like.shape
        return z.to(like) * std


class Recording:
    """Passes draws through from another source and keeps a copy of each."""

    def __init__(self, inner) -> None:
        self.inner, self.drawn = inner, []

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        z = self.inner.normal(like, std)
        self.drawn.append(z.clone())
        return z


def tiny_data(n: int = 48, d: int = 5, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g) * 3, torch.randint(0, 3, (n,), generator=g))


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def run(algorithm: str, *, model: nn.Module | None = None, data=None, **options):
    """make_private with small defaults: 48 examples, B = 8 (6 steps per epoch)."""
    model = model if model is not None else tiny_model()
    settings = dict(batch_size=8, delta=1e-3, max_grad_norm=1.0, epochs=2, seed=3,
                    noise_multiplier=1.0, algorithm=algorithm)  # fmt: skip
    settings.update(options)
    if "target_epsilon" in options:
        settings.pop("noise_multiplier")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    return dpfy.make_private(model, optimizer, data if data is not None else tiny_data(),
                             **settings)  # fmt: skip


def train(private, steps: int | None = None, loss=None) -> None:
    """The user's ordinary loop over the private loader (``steps``: stop after that many)."""
    loss = loss or nn.functional.cross_entropy
    for i, (x, y) in enumerate(rest_of_run(private.loader), start=1):
        private.optimizer.zero_grad()
        loss(private.model(x), y).backward()
        private.optimizer.step()
        if i == steps:
            break


def factorised(kind, params, source, strategy, steps, per_epoch, std=1.0):
    """A BandMF or BLT mechanism over batches in one repeated order of ``per_epoch`` steps."""
    charges = epoch_charges(decode_strategy(kind.kind, strategy), steps, per_epoch)
    return kind(params, source, std, strategy=tuple(strategy), charges=charges)


def strategy_of(plan: PrivacyPlan):
    return decode_strategy(plan.mechanism, plan.strategy)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε of the Gaussian mechanism of μ = Δ/σ, from its exact δ(ε) (Balle & Wang 2018)."""

    def excess(eps: float) -> float:
        upper = stats.norm.cdf(-eps / mu + mu / 2)
        lower = stats.norm.cdf(-eps / mu - mu / 2)
        return upper - math.exp(eps) * lower - delta

    return optimize.brentq(excess, 0.0, 100.0, xtol=1e-12)


# -- the noise -----------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_noise_added_to_zero_gradients_has_the_strategys_covariance(algorithm):
    # Zero inputs give zero gradients, and SGD at lr = 1 moves the weights by minus the noisy
    # gradient: the step-to-step changes of 40 000 coordinates over T = 12 steps are 40 000 draws
    # of the noise vector (w_1..w_T), whose covariance must be (σC/B)² · C⁻¹C⁻ᵀ. Each entry of
    # the empirical covariance is within 6 standard errors √((M_ii M_jj + M_ij²)/D).
    d, sigma, c, b, steps = 40_000, 1.5, 0.5, 8, 12
    model = nn.Linear(d, 1, bias=False)
    nn.init.zeros_(model.weight)
    data = TensorDataset(torch.zeros(32, d), torch.zeros(32))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), data, batch_size=b, delta=1e-3,
        max_grad_norm=c, noise_multiplier=sigma, epochs=3, seed=11, algorithm=algorithm,
    )  # fmt: skip
    assert private.plan.steps == steps
    updates, before = [], model.weight.detach().clone()
    mse = lambda out, y: nn.functional.mse_loss(out.squeeze(1), y)  # noqa: E731
    for x, y in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        mse(private.model(x), y).backward()
        private.optimizer.step()
        now = model.weight.detach().clone()
        updates.append((before - now).double().flatten())
        before = now
    w = torch.stack(updates).numpy() / (sigma * c / b)  # in units of the std of z
    empirical = w @ w.T / d
    inverse = toeplitz_matrix(strategy_of(private.plan).inverse_toeplitz(steps), steps)
    expected = inverse @ inverse.T
    diag = np.diag(expected)
    tolerance = 6 * np.sqrt((np.outer(diag, diag) + expected**2) / d)
    assert np.all(np.abs(empirical - expected) <= tolerance), np.abs(empirical - expected).max()
    assert not np.allclose(expected, np.eye(steps), atol=0.05)  # really correlated


@pytest.mark.parametrize(
    "strategy",
    [
        BandedStrategy((1.0, 0.6, 0.35, 0.1)),
        optimise_banded(20, 6, MinSeparation(3, 7)),
        Blt((0.4, 0.9), (0.3, 0.2)),
        optimise_blt(20, 3, MinSeparation(3, 7)),
    ],
    ids=["banded", "banded-optimised", "blt", "blt-optimised"],
)
def test_the_torch_stream_equals_the_numpy_reference_given_the_same_z(strategy):
    shapes = {"a": (3, 4), "b": (5,)}
    steps = 20
    g = torch.Generator().manual_seed(0)
    z = [{n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
         for _ in range(steps)]  # fmt: skip
    params = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()}
    kind = BandedMechanism if isinstance(strategy, BandedStrategy) else BltMechanism
    replay = Replay([step[n] for step in z for n in shapes])
    mechanism = factorised(kind, params, replay, encode_strategy(strategy), steps, 7)
    reference = {
        n: (BandedNoise if kind is BandedMechanism else BltNoise)(strategy) for n in shapes
    }
    released = []
    for t in range(steps):
        noisy = mechanism.privatise({n: torch.zeros(s, dtype=torch.float64)
                                     for n, s in shapes.items()})  # fmt: skip
        for n in shapes:
            expected = reference[n].step(z[t][n].numpy())
            np.testing.assert_allclose(noisy[n].numpy(), expected, rtol=1e-10, atol=1e-12)
        released.append(noisy["b"].numpy().copy())
    assert mechanism.steps_done == steps
    # and C w = z: the stream is the inverse it claims to be (dense check)
    dense = toeplitz_matrix(strategy.toeplitz(steps), steps)
    drawn = np.stack([step["b"].numpy() for step in z])
    np.testing.assert_allclose(dense @ np.stack(released), drawn, rtol=1e-9, atol=1e-9)


def test_banded_state_is_the_last_b_minus_1_outputs_and_blt_state_is_d_buffers():
    params = {"w": torch.zeros(7)}
    banded = factorised(BandedMechanism, params, ZeroNoise(), (1.0, 0.5, 0.25, 0.1), 10, 5)
    blt = factorised(BltMechanism, params, ZeroNoise(), (0.3, 0.8, 0.4, 0.2), 10, 5)
    for t in range(6):
        banded.privatise({"w": torch.zeros(7)})
        blt.privatise({"w": torch.zeros(7)})
        assert len(banded.state_dict()["buffers"]["w"]) == min(t + 1, 3)
        assert len(blt.state_dict()["buffers"]["w"]) == 2


def test_every_parameter_is_noised_every_step_even_with_nothing_to_add():
    # Zero clipped sums (an empty batch's) and a parameter no example touches (a zero gradient)
    # still get their noise every step, and the step is accounted.
    for kind, strategy in ((BandedMechanism, (1.0, 0.5)), (BltMechanism, (0.5, 0.3))):
        params = {"used": torch.zeros(4), "unused": torch.zeros(2, 3)}
        source = dpfy.train.noise.source.TorchNoise(seed=0)
        mechanism = factorised(kind, params, source, strategy, 3, 3, std=0.7)
        for _ in range(3):
            noisy = mechanism.privatise({n: torch.zeros_like(p) for n, p in params.items()})
            assert all(bool((t != 0).all()) for t in noisy.values())
    model = tiny_model()
    model.register_parameter("idle", nn.Parameter(torch.zeros(3)))  # never used in forward
    private = run("blt", model=model)
    train(private, steps=4)
    assert bool((model.idle.detach() != 0).all())
    assert private.ledger.steps == 4


# -- accounting ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("steps", "per_epoch"), [(12, 4), (13, 4), (30, 10), (7, 7), (50, 6)])
@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_per_epoch_charges_compose_to_the_runs_gaussian(steps, per_epoch, kind):
    participation = epoch_participation(steps, per_epoch)
    strategy = (
        optimise_banded(steps, min(per_epoch + 2, steps), participation)
        if kind == "banded"
        else optimise_blt(steps, 3, participation)
    )
    sigma = 2.0
    charges = epoch_charges(strategy, steps, per_epoch)
    events = [charges.step_event(t, sigma) for t in range(steps)]
    assert all(isinstance(e, NoOpEvent) for t, e in enumerate(events) if t % per_epoch)
    whole = correlated_accounting(strategy, participation, steps, sigma)
    assert sum(charges.increments) == pytest.approx(whole.sensitivity.squared, rel=1e-12)
    rdp = make_accountant("rdp", ZERO_OUT)
    for event in events:
        rdp.compose(event)
    alone = make_accountant("rdp", ZERO_OUT).compose(whole.event)
    assert rdp.epsilon(1e-6) == pytest.approx(alone.epsilon(1e-6), rel=1e-9)  # RDP adds exactly


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ledger_after_a_full_run_is_correlated_accounting_and_the_gaussian_at_sigma_over_delta(
    algorithm,
):
    dpa = pytest.importorskip("dp_accounting")
    private = run(algorithm, epochs=3, target_epsilon=2.0)
    train(private)
    plan, delta = private.plan, private.plan.delta
    per_epoch = plan.dataset_size // plan.expected_batch_size
    whole = correlated_accounting(
        strategy_of(plan), MinSeparation(3, per_epoch), plan.steps, plan.noise_multiplier
    )
    assert private.ledger.steps == plan.steps == 18
    ours = private.ledger.epsilon()
    assert ours <= 2.0 and ours > 2.0 * 0.99  # calibrated, not wasteful
    pld = make_accountant("pld", ZERO_OUT).compose(whole.event).epsilon(delta)
    assert ours == pytest.approx(pld, rel=2e-3)
    mu = whole.sensitivity.norm / plan.noise_multiplier
    assert ours == pytest.approx(gaussian_epsilon(mu, delta), rel=2e-3)
    theirs = (
        dpa.pld.PLDAccountant(
            neighboring_relation=dpa.NeighboringRelation.REPLACE_SPECIAL,
            value_discretization_interval=1e-4,
        )
        .compose(dpa.GaussianDpEvent(1 / mu))
        .get_epsilon(delta)
    )
    assert ours == pytest.approx(theirs, rel=2e-3)
    rdp = run(algorithm, epochs=3, accountant="rdp", noise_multiplier=plan.noise_multiplier)
    train(rdp)  # RDP composes the per-epoch Gaussians exactly
    alone = make_accountant("rdp", ZERO_OUT).compose(GaussianEvent(1 / mu))
    assert rdp.ledger.epsilon() == pytest.approx(alone.epsilon(delta), rel=1e-9)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_budget_guard_refuses_the_next_epoch_before_anything_changes(algorithm):
    private = run(algorithm, epochs=3, target_epsilon=2.0)
    train(private, steps=6)  # the first epoch
    private.ledger.record_event(GaussianEvent(1.0), label="tuning")  # spends most of ε
    batches = iter(private.loader)
    x, y = next(batches)  # the next epoch's first batch: its increment no longer fits
    model = copy.deepcopy(private.model.state_dict())
    noise = copy.deepcopy(private.optimizer.mechanism.state_dict())
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y).backward()
    with pytest.raises(BudgetExhausted):
        private.optimizer.step()
    assert all(torch.equal(model[k], v) for k, v in private.model.state_dict().items())
    after = private.optimizer.mechanism.state_dict()
    assert after["steps_done"] == noise["steps_done"] == 6 == private.ledger.steps
    for name, tensors in noise["buffers"].items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, after["buffers"][name], strict=True))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_step_beyond_the_plan_or_out_of_order_is_refused(algorithm):
    private = run(algorithm, epochs=1)
    train(private)
    mechanism = private.optimizer.mechanism
    with pytest.raises(BatchRefused, match="all taken"):
        mechanism.check(DrawnBatch(6, 8, epoch_position=0))
    fresh = run(algorithm, epochs=1).optimizer.mechanism
    with pytest.raises(BatchRefused, match="skipped"):
        fresh.check(DrawnBatch(0, 8, epoch_position=1))


# -- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_resume_continues_the_buffers_exactly_and_draws_fresh_z(algorithm, tmp_path):
    # Saved mid-epoch (after step 8 of 6-step epochs). The buffers of past noise are restored
    # exactly: with the fresh draws silenced on both sides, the resumed run ends where the
    # uninterrupted one does, and where buffers emptied by hand would not (the silenced noise
    # left is the correlated stream's tail). The resumed run's z are fresh: never the stream
    # the interrupted run drew on from its checkpoint.
    whole = run(algorithm, epochs=3)
    train(whole, steps=8)
    whole.save(tmp_path / "ckpt.pt")
    saved = whole.optimizer.mechanism.state_dict()
    whole.optimizer.noise = ZeroNoise()
    train(whole)

    resumed = run(algorithm, epochs=3)
    resumed.load(tmp_path / "ckpt.pt")
    loaded = resumed.optimizer.mechanism.state_dict()
    assert loaded["steps_done"] == 8
    for name, tensors in saved["buffers"].items():
        assert tensors and all(
            torch.equal(a, b) for a, b in zip(tensors, loaded["buffers"][name], strict=True)
        )
    resumed.optimizer.noise = ZeroNoise()
    train(resumed)
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert resumed.ledger.steps == whole.ledger.steps == 18
    assert resumed.ledger.epsilon() == pytest.approx(whole.ledger.epsilon())

    emptied = run(algorithm, epochs=3)
    emptied.load(tmp_path / "ckpt.pt")
    empty = {n: [torch.zeros_like(t) for t in ts] for n, ts in loaded["buffers"].items()}
    emptied.optimizer.mechanism.load_state_dict({**loaded, "buffers": empty})
    emptied.optimizer.noise = ZeroNoise()
    train(emptied)
    assert any(
        not torch.allclose(a, b)
        for a, b in zip(emptied.model.parameters(), whole.model.parameters(), strict=True)
    )

    interrupted = run(algorithm, epochs=3)  # the same seed: the stream it drew after step 8
    train(interrupted, steps=8)
    before = Recording(interrupted.optimizer.noise)
    interrupted.optimizer.noise = before
    train(interrupted, steps=1)
    again = run(algorithm, epochs=3)
    again.load(tmp_path / "ckpt.pt")
    after = Recording(again.optimizer.noise)
    again.optimizer.noise = after
    train(again, steps=1)
    assert len(before.drawn) == len(after.drawn) == len(list(whole.model.parameters()))
    assert not any(torch.equal(a, b) for a, b in zip(before.drawn, after.drawn, strict=True))


def test_a_checkpoint_of_another_strategy_is_refused(tmp_path):
    first = run("bandmf", epochs=2)
    train(first, steps=3)
    first.save(tmp_path / "ckpt.pt")
    other = run("bandmf", epochs=2, bands=2)
    with pytest.raises(ValueError, match="different privacy settings"):
        other.load(tmp_path / "ckpt.pt")
    mechanism = other.optimizer.mechanism
    with pytest.raises(ValueError, match="strategy differs"):
        mechanism.load_state_dict(first.optimizer.mechanism.state_dict())


# -- the plan, the variants and what they refuse -------------------------------------------------
def test_the_plan_holds_the_strategy_participation_and_calibrated_sigma():
    private = run("bandmf", epochs=3, target_epsilon=2.0)
    plan = private.plan
    assert plan.mechanism == "banded-mf" and plan.algorithm == "bandmf"
    assert plan.sampler == "fixed-order-epochs" and plan.relation == "zero-out"
    assert isinstance(plan.strategy, tuple) and len(plan.strategy) == 6  # min(16, N // B) bands
    assert plan.strategy[0] == 1.0
    assert run("blt", epochs=3).plan.strategy.__len__() == 2 * 4  # 4 buffers: decays, weights
    assert len(run("bandmf", bands=3).plan.strategy) == 3
    assert len(run("blt", buffers=2).plan.strategy) == 4
    # The same request plans the same strategy (the optimiser is deterministic): resumes match.
    assert run("blt", epochs=3).plan == run("blt", epochs=3).plan


def test_the_loader_takes_one_order_every_epoch():
    private = run("blt", epochs=3)
    epochs = []
    for _ in range(3):
        epochs.append([idx for batch in private.loader.dp_sampler for idx in batch])
    assert epochs[0] == epochs[1] == epochs[2]
    assert len(set(epochs[0])) == 48
    record = private.loader.sampling_record
    assert record.kind is SamplingKind.FIXED_ORDER_EPOCHS and record.assumption_met
    with pytest.raises(ValueError, match="describes how the batches were taken only"):
        record.event(1.0)


def test_plans_that_do_not_fit_together_are_refused():
    base = run("blt").plan
    with pytest.raises(ValueError, match="does not fit sampler"):
        dataclasses_replace(base, sampler="shuffle")
    with pytest.raises(ValueError, match="zero-out"):
        dataclasses_replace(base, relation="add-or-remove")
    with pytest.raises(ValueError, match="even count"):
        dataclasses_replace(base, strategy=(0.5, 0.2, 0.1))
    with pytest.raises(ValueError, match="strategy belongs"):
        dataclasses_replace(run("dp-sgd").plan, strategy=(1.0,))
    with pytest.raises(ValueError, match="coefficients\\[0\\] must be 1"):
        dataclasses_replace(run("bandmf").plan, strategy=(0.5, 0.2))


def dataclasses_replace(plan: PrivacyPlan, **changes) -> PrivacyPlan:
    import dataclasses

    return dataclasses.replace(plan, **changes)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"user_ids": torch.arange(48) % 6}, "available at the example level"),
        ({"sampler": "shuffle"}, "one order fixed before training"),
        ({"sampler": "poisson"}, "or sampler='cyclic-poisson' (amplified BandMF)"),
        ({"sampler": "cyclic-poisson", "bands": 7}, "lower bands to at most N // B = 6"),
        ({"buffers": 3}, "buffers not supported with BandMF"),
        ({"restart_every": 2}, "restart_every not supported"),
        ({"bands": 40}, "exceeds the run's 12 steps"),
    ],
)
def test_bandmf_refuses_what_it_cannot_account_with_one_message(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        run("bandmf", **options)


def test_blt_and_the_others_refuse_the_other_size_option():
    with pytest.raises(ValueError, match="bands not supported with BLT"):
        run("blt", bands=4)
    with pytest.raises(ValueError, match="one order fixed before training"):
        run("blt", sampler="cyclic-poisson")  # a BLT is not banded: no amplification
    for algorithm in ("dp-sgd", "dp-ftrl"):
        with pytest.raises(ValueError, match="bands not supported"):
            run(algorithm, bands=4)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_microbatches_and_physical_batches_work(algorithm):
    micro = run(algorithm, microbatch_size=2)
    assert micro.optimizer.mechanism.std == pytest.approx(2 * 1.0 * 1.0 / (8 / 2))
    train(micro)
    assert micro.ledger.steps == 12
    whole, chunked = run(algorithm), run(algorithm, max_physical_batch_size=3)
    train(whole)
    train(chunked)
    for a, b in zip(whole.model.parameters(), chunked.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert chunked.ledger.epsilon() == whole.ledger.epsilon()


def test_a_white_box_audit_takes_the_strategy_from_the_plan():
    from dpfy.audit.observe import StepSettings

    plan = run("blt").plan
    settings = StepSettings.from_plan(plan)  # audited by dpfy.audit.correlated
    assert settings.noise_multiplier == plan.noise_multiplier


# -- the ledger's format -------------------------------------------------------------------------
def test_a_charged_event_round_trips_and_old_entries_still_decode():
    record = SamplingRecord(SamplingKind.FIXED_ORDER_EPOCHS, 0.1, 80, 8)
    step = StepRecord(record, 1.3, charged=GaussianEvent(0.9))
    item = encode_entry("training", 4, step, step.event)
    assert decode_entry(0, item, "training")[2] == step
    assert decode_entry(0, item, "training")[2].event == GaussianEvent(0.9)
    old = {"label": "training", "count": 2, "noise_multiplier": 1.0,
           "sampling": {"kind": "poisson", "sampling_rate": 0.1, "dataset_size": 80,
                        "batch_size": None}}  # fmt: skip
    _, count, decoded, _ = decode_entry(0, old, "training")
    assert count == 2 and decoded.charged is None
    assert decoded.event == decoded.sampling.event(1.0)
    ledger = PrivacyLedger(1e-5, relation="zero-out")
    with pytest.raises(ValueError, match="needs the mechanism's event"):
        ledger.record(StepRecord(record, 1.0))  # the record's own event is never used
    ledger.record(step)
    ledger.record(StepRecord(record, 1.3, charged=NoOpEvent()))
    again = PrivacyLedger.from_state_dict(ledger.state_dict())
    assert again.epsilon() == ledger.epsilon() > 0 and again.steps == 2


# -- report and CLI ------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_report_names_mechanism_strategy_participation_and_accounting(algorithm, tmp_path):
    private = run(algorithm, epochs=2, target_epsilon=3.0)
    train(private)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private.report(tmp_path / "report", dataset="tiny", model="mlp")
    card = (tmp_path / "report" / "report.md").read_text()
    name, size = ("BandMF", "6 bands") if algorithm == "bandmf" else ("BLT", "4 buffers")
    for phrase in (name, size, "matrix-factorisation noise", "min-separation",
                   "at most k = 2 steps", "exactly s = 6 steps apart", "σ/Δ",
                   "NO sampling assumption", "fixed-order-epochs"):  # fmt: skip
        assert phrase in card, phrase
    assert not re.search(r"\{[a-z_]*(:[^}]*)?\}", card)


def test_dpfy_train_algorithm_blt_on_digits_names_the_mechanism(tmp_path):
    from typer.testing import CliRunner

    from dpfy.cli.app import app

    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--algorithm", "blt", "--epochs", "2", "--model", "logreg",
              "--out", str(out), "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stdout + result.stderr
    assert '"algorithm": "BLT"' in result.stdout
    card = (out / "report.md").read_text()
    assert "BLT (buffered linear Toeplitz) matrix-factorisation noise" in card
    assert "BLT, 4 buffers" in card and "min-separation" in card


def test_dpfy_train_takes_the_sampler_and_strategy_size_of_the_variant(tmp_path):
    from typer.testing import CliRunner

    from dpfy.cli.app import app

    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--algorithm", "bandmf", "--sampler", "cyclic-poisson", "--bands", "2",
              "--epochs", "1", "--model", "logreg", "--out", str(out), "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stdout + result.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["sampler"], config["bands"]) == ("cyclic-poisson", 2)
    assert "cyclic" in (out / "report.md").read_text().lower()
    refused = CliRunner().invoke(
        app, ["train", "--algorithm", "dp-sgd", "--buffers", "2", "--out", str(tmp_path / "x")]
    )
    assert refused.exit_code == 2 and "buffers not supported with DP-SGD" in refused.stderr
    assert not (tmp_path / "x").exists()


def test_a_checkpoint_from_before_the_strategy_field_still_resumes(tmp_path):
    from dpfy.train.checkpoints import seal, unseal

    first = run("dp-sgd", epochs=1)
    train(first, steps=2)
    state = unseal(first.state_dict())
    del state["plan"]["strategy"]  # what dpfy wrote before plans held a strategy
    second = run("dp-sgd", epochs=1)
    second.load_state_dict(seal(state))
    assert second.ledger.steps == 2


# -- amplified BandMF: cyclic Poisson groups ------------------------------------------------------
def cyclic(**options):
    """Amplified BandMF on 48 examples, B = 4, 3 groups (q = 3·4/48 = 0.25), 2 epochs."""
    settings = dict(batch_size=4, bands=3, sampler="cyclic-poisson", epochs=2)
    settings.update(options)
    return run("bandmf", **settings)


def test_cyclic_poisson_groups_are_fixed_once_and_sampled_in_turn():
    private = cyclic()
    plan = private.plan
    assert plan.sampler == "cyclic-poisson" and plan.relation == "add-or-remove"
    assert plan.sampling_rate == 0.25 and len(plan.strategy) == 3 and plan.steps == 24
    sampler = private.loader.dp_sampler
    batches = [batch for _ in range(2) for batch in private.loader.dp_sampler]
    assert len(batches) == 24
    groups = [set(sampler.group(g).tolist()) for g in range(3)]
    assert set().union(*groups) == set(range(48)) and sum(map(len, groups)) == 48
    assert all(set(batch) <= groups[t % 3] for t, batch in enumerate(batches))
    assert len({len(batch) for batch in batches}) > 1  # Poisson: the sizes vary
    record = private.loader.sampling_record
    assert record.kind is SamplingKind.CYCLIC_POISSON and record.batch_size is None
    assert record.assumption_met


def test_amplified_ledger_is_correlated_accounting_of_cyclic_poisson():
    dpa = pytest.importorskip("dp_accounting")
    private = cyclic(target_epsilon=2.0)
    train(private)
    plan = private.plan
    strategy = strategy_of(plan)
    whole = correlated_accounting(
        strategy, CyclicPoisson(3, 0.25), plan.steps, plan.noise_multiplier
    )
    assert whole.amplified and private.ledger.steps == 24
    ours = private.ledger.epsilon()
    assert 2.0 * 0.99 < ours <= 2.0
    relation = NeighbouringRelation.ADD_OR_REMOVE
    pld = make_accountant("pld", relation).compose(whole.event).epsilon(plan.delta)
    assert ours == pytest.approx(pld, rel=1e-9)  # the very same events, composed alike
    column = whole.sensitivity.norm
    theirs_event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(0.25, dpa.GaussianDpEvent(plan.noise_multiplier / column)), 8
    )
    theirs = dpa.pld.PLDAccountant(
        neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-4,
    ).compose(theirs_event).get_epsilon(plan.delta)  # fmt: skip
    assert ours == pytest.approx(theirs, rel=5e-3)
    events = [private.optimizer.mechanism.charges.step_event(t, 1.0) for t in range(24)]
    assert [not isinstance(e, NoOpEvent) for e in events] == [t % 3 == 0 for t in range(24)]


def test_an_empty_cyclic_batch_is_still_a_noised_and_accounted_step():
    model = tiny_model()
    private = cyclic(model=model, batch_size=1, bands=2)  # q = 2/48 in groups of 24
    sizes, moved = [], []
    for x, y in rest_of_run(private.loader):
        before = [p.detach().clone() for p in model.parameters()]
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.model(x), y).backward()  # empty: no example seen
        private.optimizer.step()
        sizes.append(len(y))
        moved.append(all(bool((p != b).all()) for p, b in zip(model.parameters(), before,
                                                               strict=True)))  # fmt: skip
    assert 0 in sizes and all(moved)
    assert private.ledger.steps == len(sizes) == private.plan.steps


def test_a_cyclic_run_resumes_with_its_groups(tmp_path):
    whole = cyclic()
    train(whole, steps=5)
    whole.save(tmp_path / "ckpt.pt")
    whole.optimizer.noise = ZeroNoise()
    train(whole)
    resumed = cyclic()
    resumed.load(tmp_path / "ckpt.pt")
    resumed.optimizer.noise = ZeroNoise()
    train(resumed)
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert resumed.ledger.epsilon() == pytest.approx(whole.ledger.epsilon())


def test_the_report_of_amplified_bandmf_says_how_it_was_sampled_and_charged(tmp_path):
    private = cyclic(target_epsilon=3.0)
    train(private)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private.report(tmp_path / "report", dataset="tiny", model="mlp")
    card = (tmp_path / "report" / "report.md").read_text()
    for phrase in ("Amplified BandMF", "b = 3 groups", "q = 0.25", "⌈T/b⌉ = 8 composed",
                   "Poisson-subsampled Gaussians", "cyclic Poisson sampling",
                   "BandMF, 3 bands"):  # fmt: skip
        assert phrase in card, phrase
    assert "NO sampling assumption" not in card
    assert not re.search(r"\{[a-z_]*(:[^}]*)?\}", card)
