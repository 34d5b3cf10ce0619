"""Every path into the optimizer is exact or refused before anything changes.

Each test is one way a careful or adversarial user could make a run leak more than its ledger
says: shifted microbatches, parameters unfrozen later, batches accumulated by hand or brought
from elsewhere, layers writing to themselves in forward, DP-FTRL steps out of tree order,
parameters used outside their layer, and checkpoints that were edited or put together.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.train.grads import make_engine


def dataset(n: int = 120, d: int = 5, classes: int = 3, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=generator))


def mlp(d: int = 5, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, classes))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def private_run(model: nn.Module | None = None, **options) -> dpfy.PrivateTraining:
    model = mlp() if model is None else model
    settings = dict(batch_size=20, steps=30, noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0)
    settings.update(options)
    data = settings.pop("data", None) or dataset()
    optimizer = settings.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    return dpfy.make_private(model, optimizer, data, seed=3, **settings)


def backward(private: dpfy.PrivateTraining, batch) -> None:
    x, y = batch
    nn.functional.cross_entropy(private.model(x), y, reduction="sum").backward()


def assert_refused_unchanged(private: dpfy.PrivateTraining, match: str) -> None:
    """step() is refused with ``match`` and neither the model nor the ledger moved."""
    before, steps = flat(private.model), private.ledger.steps
    with pytest.raises((RuntimeError, ValueError), match=match):
        private.optimizer.step()
    assert torch.equal(flat(private.model), before)
    assert private.ledger.steps == steps


# -- 1. microbatch membership does not depend on the other examples ---------------------------


def clipped_update(private: dpfy.PrivateTraining, x, y, units) -> torch.Tensor:
    """One private step on (x, y) with the given microbatch slots; returns -Δθ·divisor/lr."""
    provenance = private.loader.provenance
    provenance.publish(len(x), units, None, "microbatch")  # the coupling a test may choose
    before = flat(private.model)
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y, reduction="mean").backward()
    private.optimizer.step()
    delta = before - flat(private.model)
    with torch.no_grad():
        for p, value in zip(
            private.model.parameters(), _unflatten(before, private.model), strict=True
        ):
            p.copy_(value)  # back to the same point for the neighbour
    private.optimizer.behaviour.accept_state()  # the harness's own write, not the user's
    return delta / 0.1 * private.optimizer.plan.divisor


def _unflatten(vector: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    out, start = [], 0
    for p in model.parameters():
        out.append(vector[start : start + p.numel()].view_as(p))
        start += p.numel()
    return out


def test_microbatch_clipped_sum_moves_at_most_2C_when_one_record_is_added():
    """Over many random neighbouring pairs, the clipped sum moves by at most the 2C accounted."""
    clip, k = 1.0, 4
    private = private_run(
        batch_size=16, microbatch_size=k, max_grad_norm=clip, noise_multiplier=1e-12
    )
    slots = private.loader.microbatches.slots
    rng = random.Random(0)
    worst = 0.0
    for trial in range(40):
        n = rng.randint(1, 24)
        g = torch.Generator().manual_seed(trial)
        x, y = torch.randn(n + 1, 5, generator=g) * 10, torch.randint(0, 3, (n + 1,), generator=g)
        units = torch.randint(slots, (n + 1,), generator=g)
        added = rng.randrange(n + 1)  # anywhere in the index order
        keep = [i for i in range(n + 1) if i != added]
        smaller = clipped_update(private, x[keep], y[keep], units[keep])
        larger = clipped_update(private, x, y, units)
        worst = max(worst, float((larger - smaller).norm()))
    assert worst <= 2 * clip * (1 + 1e-4)
    assert worst > 0.5 * clip  # the pairs did exercise the bound


def test_microbatch_slots_are_drawn_per_example_uniformly_and_independently_of_position():
    data = dataset(400)
    private = private_run(data=data, batch_size=100, microbatch_size=10, steps=60)
    slots = private.loader.microbatches.slots
    counts = torch.zeros(slots)
    first_slots = []
    for x, _ in rest_of_run(private.loader):
        units = private.loader.provenance.current.units
        assert units is not None and units.shape == (len(x),)
        assert int(units.min()) >= 0 and int(units.max()) < slots
        counts += torch.bincount(units, minlength=slots)
        first_slots.append(int(units[0]))
    expected = counts.sum() / slots
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50  # 9 degrees of freedom: uniform slots
    assert len(set(first_slots)) > 3  # example 0 of a batch is not always in microbatch 0


def test_virtual_batches_never_split_a_microbatch():
    private = private_run(batch_size=40, microbatch_size=4, max_physical_batch_size=7)
    for _ in zip(range(3), private.loader, strict=False):
        chunk = private.optimizer.boundary.chunk
        units = private.loader.provenance.current.units
        start, stop = chunk
        inside = set(units[start:stop].tolist())
        outside = set(units[:start].tolist()) | set(units[stop:].tolist())
        assert not inside & outside


# -- 2. parameters that became trainable after make_private -----------------------------------


def test_a_layer_unfrozen_after_make_private_is_refused_before_the_step():
    model = mlp()
    model[0].requires_grad_(False)
    private = private_run(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].requires_grad_(True)  # gradual unfreezing
    backward(private, next(iter(private.loader)))
    assert_refused_unchanged(private, "frozen .* when the run was made private")


def test_a_param_group_added_after_make_private_is_refused_before_the_step():
    private = private_run()
    extra = nn.Linear(5, 3)
    private.optimizer.add_param_group({"params": list(extra.parameters())})
    backward(private, next(iter(private.loader)))
    assert_refused_unchanged(private, "un-noised")


# -- 3. gradient accumulation by hand ---------------------------------------------------------


@pytest.mark.parametrize("engine", ["fast", "vmap"])
def test_two_loader_batches_accumulated_into_one_step_are_refused(engine):
    private = private_run(engine=engine)
    batches = iter(private.loader)
    private.optimizer.zero_grad()
    backward(private, next(batches))
    backward(private, next(batches))
    assert_refused_unchanged(private, "max_physical_batch_size")


# -- 4. batches from anywhere but the private sampler -----------------------------------------


def test_a_batch_from_a_plain_dataloader_is_refused():
    data = dataset()
    private = private_run(data=data)
    batch = next(iter(DataLoader(data, batch_size=20, shuffle=True)))
    backward(private, batch)
    assert_refused_unchanged(private, "not drawn by the run's private loader")


def test_a_hand_made_slice_of_a_loader_batch_is_refused():
    private = private_run()
    x, y = next(iter(private.loader))
    backward(private, (x[:-1], y[:-1]))
    assert_refused_unchanged(private, "drew a batch of")


def test_a_batch_stepped_on_twice_is_refused():
    private = private_run()
    batch = next(iter(private.loader))
    backward(private, batch)
    private.optimizer.step()
    backward(private, batch)
    assert_refused_unchanged(private, "already used for a step")


def test_a_step_with_no_batch_drawn_is_refused():
    private = private_run()
    assert_refused_unchanged(private, "not drawn by the run's private loader")


def test_a_skipped_batch_is_refused_and_a_reload_goes_on():
    private = private_run()
    start = private.state_dict()
    batches = iter(private.loader)
    next(batches)  # drawn, looked at, never stepped on: a data-dependent skip
    backward(private, next(batches))
    assert_refused_unchanged(private, "skipped")
    private.load_state_dict(start)
    private.optimizer.zero_grad()
    backward(private, next(iter(private.loader)))
    private.optimizer.step()
    assert private.ledger.steps == 1


def test_a_checkpoint_taken_mid_batch_resumes_on_that_batch():
    private = private_run()
    trained(private, 2)
    batch = next(iter(private.loader))  # in hand, not stepped on
    state = private.state_dict()
    resumed = private_run()
    resumed.load_state_dict(state)
    again = next(iter(resumed.loader))
    assert all(torch.equal(a, b) for a, b in zip(batch, again, strict=True))


# -- 5. data-dependent writes outside clipping ------------------------------------------------


def test_embedding_with_max_norm_is_refused_at_make_private():
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match="max_norm"):
        private_run(
            model, data=TensorDataset(torch.randint(0, 10, (50, 2)), torch.zeros(50).long())
        )
    with pytest.warns(UserWarning, match="replaced 1 layer"):
        fixed = dpfy.fix(model)
    assert fixed[0].max_norm is None and torch.equal(fixed[0].weight, model[0].weight)
    assert model[0].max_norm == 1.0  # the original is left as it was
    private_run(fixed, data=TensorDataset(torch.randint(0, 10, (50, 2)), torch.zeros(50).long()))


class SelfUpdating(nn.Module):
    """Scales its weight in place from the batch during forward: a write outside clipping."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.weight.mul_(1 + 1e-3 * x.mean())
        return self.linear(x)


@pytest.mark.parametrize("engine", ["fast", "vmap"])
def test_a_layer_writing_to_its_parameters_in_forward_is_refused(engine):
    private = private_run(SelfUpdating(), engine=engine)
    backward(private, next(iter(private.loader)))
    # the state watch sees the write first (the engine's version check is the second line)
    with pytest.raises(dpfy.StateChanged, match=r"'linear\.weight' changed outside the private"):
        private.optimizer.step()
    assert private.ledger.steps == 0


class RunningMean(nn.Module):
    """Keeps an un-noised running mean of its inputs in a buffer, rebound in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.register_buffer("mean", torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return self.linear(x - self.mean)


def test_a_layer_rebinding_its_buffer_from_the_data_in_forward_is_refused():
    private = private_run(RunningMean())
    backward(private, next(iter(private.loader)))
    with pytest.raises(dpfy.StateChanged, match="'mean' changed outside the private step"):
        private.optimizer.step()
    assert private.ledger.steps == 0


def test_spectral_norm_power_iteration_is_not_a_write_from_the_data():
    """Its u and v follow the weight matrix alone, so the run trains (auto picks an engine)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(5, 16)), nn.ReLU(), nn.Linear(16, 3))
    private = private_run(model)
    for _, batch in zip(range(2), private.loader, strict=False):
        private.optimizer.zero_grad()
        backward(private, batch)
        private.optimizer.step()
    assert private.ledger.steps == 2


@pytest.mark.parametrize(
    "parametrization",
    [nn.utils.parametrizations.spectral_norm, nn.utils.parametrizations.weight_norm],
)
def test_a_parametrized_weight_is_refused_with_one_message(parametrization):
    model = nn.Sequential(parametrization(nn.Linear(5, 16)), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(ValueError, match="parametrized weight"):
        private_run(model)


# -- 6. DP-FTRL steps follow the loader's epochs ----------------------------------------------


def ftrl_run() -> dpfy.PrivateTraining:
    model = mlp()
    return dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), batch_size=20, steps=30,
        noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, algorithm="dp-ftrl", seed=1,
    )  # fmt: skip


def test_ftrl_extra_noise_only_step_is_refused():
    private = ftrl_run()
    backward(private, next(iter(private.loader)))
    private.optimizer.step()
    assert_refused_unchanged(private, "already used for a step")


def test_ftrl_step_after_a_skipped_batch_is_refused():
    private = ftrl_run()
    batches = iter(private.loader)
    next(batches)  # drawn, never stepped on
    backward(private, next(batches))
    assert_refused_unchanged(private, "skipped")


def test_ftrl_tree_positions_follow_the_loader_across_epochs():
    private = ftrl_run()
    positions = []
    for batch in rest_of_run(private.loader):
        positions.append(private.loader.provenance.current.epoch_position)
        private.optimizer.zero_grad()
        backward(private, batch)
        private.optimizer.step()
    assert positions == [i % 6 for i in range(30)]


# -- 7. parameters used outside their layer (vmap) --------------------------------------------


class TiedOutput(nn.Module):
    """Uses the embedding's weight again through torch.nn.functional (weight tying by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.mix(self.embed(ids)), self.embed.weight)


def token_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 10, (60,), generator=g), torch.randint(0, 10, (60,)))


def test_vmap_parameter_used_outside_its_layer_is_refused():
    private = private_run(TiedOutput(), engine="vmap", data=token_data())
    backward(private, next(iter(private.loader)))
    with pytest.raises(RuntimeError, match="used outside the layer that owns it"):
        private.optimizer.step()
    assert private.ledger.steps == 0


class SharedBias(nn.Module):
    """A parent owns a bias that its child layer also owns (BertLMPredictionHead's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(5, 3, bias=False)
        self.bias = nn.Parameter(torch.zeros(3))
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


def test_vmap_bias_owned_by_parent_and_child_is_counted_once():
    torch.manual_seed(0)
    model = SharedBias()
    reference_model = copy.deepcopy(model)  # keeps the sharing: one bias in both places
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    reference = []
    for i in range(6):
        reference_model.zero_grad()
        loss = nn.functional.cross_entropy(reference_model(x[i : i + 1]), y[i : i + 1])
        loss.backward()
        grads = [reference_model.decoder.weight.grad, reference_model.bias.grad]
        reference.append(torch.cat([g.flatten() for g in grads]).norm())
    engine = make_engine(model, "vmap")
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    result = engine.clip_and_accumulate(1e6, "sum")  # no clipping: the norms are the true ones
    torch.testing.assert_close(result.norms, torch.stack(reference), rtol=1e-5, atol=1e-6)


# -- 8. checkpoints ---------------------------------------------------------------------------


def trained(private: dpfy.PrivateTraining, steps: int) -> dpfy.PrivateTraining:
    for _, batch in zip(range(steps), private.loader, strict=False):
        private.optimizer.zero_grad()
        backward(private, batch)
        private.optimizer.step()
    return private


def test_a_checkpoint_with_an_earlier_ledger_is_refused():
    private = trained(private_run(), 2)
    early = private.state_dict()
    trained(private, 3)
    late = private.state_dict()
    forged = {**late, "ledger": early["ledger"]}
    with pytest.raises(ValueError, match="digest"):
        private_run().load_state_dict(forged)
    from dpfy.train.checkpoints import seal

    resealed = seal({k: v for k, v in forged.items() if k not in ("format", "version", "digest")})
    with pytest.raises(ValueError, match="records 2 training steps but its sampler"):
        private_run().load_state_dict(resealed)


def test_a_checkpoint_with_another_runs_ledger_is_refused():
    from dpfy.train.checkpoints import seal

    mine, theirs = trained(private_run(), 3).state_dict(), trained(private_run(), 3).state_dict()
    body = {k: v for k, v in mine.items() if k not in ("format", "version", "digest")}
    with pytest.raises(ValueError, match="belongs to run"):
        private_run().load_state_dict(seal({**body, "ledger": theirs["ledger"]}))


def test_a_checkpoint_with_an_emptied_ledger_is_refused():
    from dpfy.train.checkpoints import seal

    private = trained(private_run(), 3)
    empty = private_run()
    empty.ledger.run_id = private.run_id
    body = {
        k: v for k, v in private.state_dict().items() if k not in ("format", "version", "digest")
    }
    with pytest.raises(ValueError, match="records 0 training steps"):
        private_run().load_state_dict(seal({**body, "ledger": empty.ledger.state_dict()}))


def test_a_checkpoint_holding_only_the_format_marker_is_refused_with_one_message():
    with pytest.raises(ValueError, match="lacks plan, model"):
        private_run().load_state_dict({"format": "dpfy.checkpoint", "version": 3})


def test_random_bit_flips_in_a_checkpoint_file_never_load_changed_state(tmp_path):
    private = trained(private_run(), 3)
    path = private.save(tmp_path / "run.pt")
    original = path.read_bytes()
    reference = private_run()
    reference.load(path)
    expected = reference.state_dict()["digest"]
    rng = random.Random(0)
    loaded_unchanged = refused = 0
    for trial in range(150):
        data = bytearray(original)
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        flipped = tmp_path / f"flip{trial}.pt"
        flipped.write_bytes(bytes(data))
        target = private_run()
        try:
            target.load(flipped)
        except ValueError:
            refused += 1
            continue
        assert target.state_dict()["digest"] == expected  # loaded only if nothing changed
        loaded_unchanged += 1
    assert refused > 100


class NoNoise:
    """Adds nothing: what is left of a step is its clipped gradients."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


def test_a_resumed_checkpoint_continues_exactly():
    # Everything but the noise continues exactly: the resume draws fresh noise (replaying the
    # stream would let two continuations cancel it), so the noise is silenced on both sides.
    private = trained(private_run(), 3)
    state = private.state_dict()
    resumed = private_run()
    resumed.load_state_dict(state)
    private.optimizer.noise = resumed.optimizer.noise = NoNoise()
    trained(private, 2)
    trained(resumed, 2)
    torch.testing.assert_close(flat(private.model), flat(resumed.model), rtol=0, atol=0)
    assert resumed.ledger.steps == private.ledger.steps == 5
    assert resumed.run_id == private.run_id


def test_going_back_to_an_earlier_checkpoint_keeps_what_was_spent(tmp_path):
    private = trained(private_run(), 2)
    path = private.save(tmp_path / "early.pt")
    trained(private, 3)
    spent = private.epsilon()
    private.load(path)
    assert private.ledger.steps == 2  # the model and sampler are back at step 2 ...
    assert private.epsilon() >= spent * (1 - 1e-9)  # ... but the 3 released steps still count
    trained(private, 1)
    private.load_state_dict(copy.deepcopy(private.state_dict()))  # binds: 3 steps, 3 stepped


def test_a_frozen_parameter_holding_a_stale_gradient_is_named():
    model = mlp()
    nn.functional.cross_entropy(model(torch.randn(4, 5)), torch.zeros(4).long()).backward()
    model[0].requires_grad_(False)  # frozen after pretraining, its .grad left behind
    private = private_run(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    backward(private, next(iter(private.loader)))
    assert_refused_unchanged(private, "holds a .grad")


# -- 12. secure mode covers sampling too ------------------------------------------------------


def test_secure_noise_draws_sampling_from_the_os_too():
    model = mlp()
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), batch_size=20, steps=5,
        noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, secure_noise=True,
    )  # fmt: skip
    assert private.loader.dp_sampler.secure
    trained(private, 2)
    assert private.ledger.steps == 2


def test_secure_noise_with_a_seed_is_refused():
    with pytest.raises(ValueError, match="no seed can"):
        private_run(secure_noise=True)


# -- DataLoader options on the private loader -------------------------------------------------


def test_workers_on_the_private_loader_train_the_same_run():
    def run(options: dict | None) -> torch.Tensor:
        private = private_run(steps=4, loader_options=options)
        trained(private, 4)
        assert private.ledger.steps == 4
        return flat(private.model)

    torch.testing.assert_close(run({"num_workers": 2}), run(None), rtol=0, atol=0)


def test_loader_options_that_decide_the_sampling_are_refused():
    with pytest.raises(ValueError, match="may not set batch_size, sampler"):
        private_run(loader_options={"sampler": None, "batch_size": 3})
