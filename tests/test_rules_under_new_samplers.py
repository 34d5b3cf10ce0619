"""Every privacy rule that holds under Poisson sampling still holds under the new samplers.

Truncated Poisson (every batch M rows, padding marked) and balls-in-bins (each example in one
uniformly random batch per epoch) reach the same optimizer by the same loop: a batch from
elsewhere, a batch stepped on twice, a batch cut by hand, a parameter unfrozen after
make_private are refused before anything changes; the private gradient is the per-example
clipped sum over the examples (padding rows, however adversarial, contribute exactly nothing)
divided by the expected batch size; the ledger records one step of the right sampling kind per
step, an empty batch included; a checkpoint resumes the same batches.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpfy
from dpfy.data.padding import PAD_INDEX
from dpfy.data.provenance import BatchRefused
from dpfy.plan.sampling import SamplingKind

SAMPLERS = {
    "truncated-poisson": {"sampler": "truncated-poisson", "max_batch_size": 54},
    "balls-in-bins": {"sampler": "balls-in-bins"},
}
KINDS = {
    "truncated-poisson": SamplingKind.TRUNCATED_POISSON,
    "balls-in-bins": SamplingKind.BALLS_IN_BINS,
}
every_sampler = pytest.mark.parametrize("sampler", list(SAMPLERS))


def dataset(n: int = 120, d: int = 5, classes: int = 3, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=generator))


def mlp(d: int = 5, classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, classes))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def private_run(sampler: str, model: nn.Module | None = None, **options) -> dpfy.PrivateTraining:
    model = mlp() if model is None else model
    settings = dict(batch_size=20, steps=18, noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0)
    settings.update(SAMPLERS[sampler])
    settings.update(options)
    data = settings.pop("data", None) or dataset()
    optimizer = settings.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    seed = settings.pop("seed", 3)
    return dpfy.make_private(model, optimizer, data, seed=seed, **settings)


def backward(private: dpfy.PrivateTraining, batch) -> None:
    x, y = batch
    nn.functional.cross_entropy(private.model(x), y).backward()


def trained(private: dpfy.PrivateTraining, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """Take ``steps`` steps (over passes: one pass is one epoch); the batches stepped on."""
    batches: list[tuple[torch.Tensor, ...]] = []
    while len(batches) < steps:
        for batch in private.loader:
            private.optimizer.zero_grad()
            backward(private, batch)
            private.optimizer.step()
            batches.append(batch)
            if len(batches) == steps:
                break
    return batches


def assert_refused_unchanged(private: dpfy.PrivateTraining, match: str) -> None:
    """step() is refused with ``match`` and neither the model nor the ledger moved."""
    before, steps = flat(private.model), private.ledger.steps
    with pytest.raises((RuntimeError, ValueError), match=match):
        private.optimizer.step()
    assert torch.equal(flat(private.model), before)
    assert private.ledger.steps == steps


class NoNoise:
    """Adds nothing: what is left of a step is its clipped gradients (σ → 0)."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


# -- batches from anywhere but the private sampler ----------------------------------------------
@every_sampler
def test_a_batch_from_a_plain_dataloader_is_refused(sampler):
    data = dataset()
    private = private_run(sampler, data=data)
    rows = 54 if sampler == "truncated-poisson" else 20  # the loader's shape, even
    batch = next(iter(DataLoader(data, batch_size=rows, shuffle=True)))
    backward(private, batch)
    assert_refused_unchanged(private, "not drawn by the run's private loader")


@pytest.mark.xfail(
    strict=True,
    reason="known limit of the hooked step (README, limits; the compiled step checks the tensors "
    "themselves): provenance stamps a layer call with "
    "the batch in hand at forward time, and the only check of the rows is their count, so a "
    "plain DataLoader batch of the same row count fed while a loader batch is in hand is "
    "accepted and accounted as the sampled one; under truncated Poisson every batch has M rows, "
    "so the count never catches it (Poisson and balls-in-bins: only when sizes happen to match)",
)
@every_sampler
def test_a_plain_batch_of_the_same_shape_fed_while_a_loader_batch_is_in_hand_is_refused(sampler):
    data = dataset()
    private = private_run(sampler, data=data)
    rows = next(iter(private.loader))[0].shape[0]  # drawn, then swapped for another batch
    batch = next(iter(DataLoader(data, batch_size=rows, shuffle=True)))
    backward(private, batch)
    assert_refused_unchanged(private, "not drawn by the run's private loader")


@every_sampler
def test_a_batch_stepped_on_twice_is_refused(sampler):
    private = private_run(sampler)
    batch = next(iter(private.loader))
    backward(private, batch)
    private.optimizer.step()
    private.optimizer.zero_grad()
    backward(private, batch)
    assert_refused_unchanged(private, "already used for a step")


@every_sampler
def test_two_loader_batches_in_one_step_are_refused(sampler):
    private = private_run(sampler)
    batches = iter(private.loader)
    backward(private, next(batches))
    backward(private, next(batches))
    assert_refused_unchanged(private, "max_physical_batch_size")


@every_sampler
def test_a_hand_made_slice_of_a_loader_batch_is_refused(sampler):
    private = private_run(sampler)
    x, y = next(iter(private.loader))
    backward(private, (x[:-1], y[:-1]))
    match = "padded this batch to 54 rows" if sampler == "truncated-poisson" else "drew a batch of"
    assert_refused_unchanged(private, match)


def test_a_padded_batch_cut_to_its_examples_is_refused():
    """Cutting off the padding by hand gives the drawn examples, but not the static batch the
    loader padded: the engine refuses any other row count (shapes are static)."""
    private = private_run("truncated-poisson")
    x, y = next(iter(private.loader))
    real = private.loader.provenance.current.padding.real
    assert 0 < real < x.shape[0]
    backward(private, (x[:real], y[:real]))
    assert_refused_unchanged(private, f"padded this batch to 54 rows but the step saw {real}")


# -- parameters that became trainable after make_private ----------------------------------------
@every_sampler
def test_a_layer_unfrozen_after_make_private_is_refused(sampler):
    model = mlp()
    model[0].requires_grad_(False)
    private = private_run(sampler, model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].requires_grad_(True)  # gradual unfreezing
    backward(private, next(iter(private.loader)))
    assert_refused_unchanged(private, "frozen .* when the run was made private")


# -- the private gradient is exact ---------------------------------------------------------------
def clipped_reference(model: nn.Module, x, y, clip: float) -> torch.Tensor:
    """Σ_i min(1, C/‖g_i‖)·g_i over the given rows, one backward pass per example."""
    reference = mlp()
    reference.load_state_dict(model.state_dict())  # a copy without the engine's hooks
    total = torch.zeros_like(flat(reference))
    for i in range(x.shape[0]):
        reference.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(reference(x[i : i + 1]), y[i : i + 1]).backward()
        grad = torch.cat([p.grad.flatten() for p in reference.parameters()])
        total += min(1.0, clip / float(grad.norm())) * grad
    return total


def adversarial_dataset() -> TensorDataset:
    """dataset[PAD_INDEX] (what padding rows copy) has a gradient ~10⁴ times the others'."""
    data = dataset()
    x, y = data.tensors
    x = x.clone()
    x[PAD_INDEX] = 1e4
    return TensorDataset(x, y)


@every_sampler
def test_the_private_gradient_is_the_clipped_sum_of_the_examples_over_b(sampler):
    private = private_run(sampler, data=adversarial_dataset(), max_grad_norm=0.5)
    private.optimizer.noise = NoNoise()
    for _ in range(3):
        x, y = next(iter(private.loader))
        drawn = private.loader.provenance.current
        real = drawn.size
        if sampler == "truncated-poisson":
            assert x.shape[0] == 54 and drawn.padding.real == real
            assert torch.equal(x[real:], x.new_full((54 - real, 5), 1e4))  # adversarial padding
        else:
            assert drawn.padding is None and x.shape[0] == real
        expected = clipped_reference(private.model, x[:real], y[:real], 0.5) / 20  # B = 20
        before = flat(private.model)
        private.optimizer.zero_grad()
        backward(private, (x, y))
        private.optimizer.step()
        update = (before - flat(private.model)) / 0.1  # SGD at lr 0.1
        torch.testing.assert_close(update, expected, rtol=1e-4, atol=1e-6)


def test_padding_content_never_reaches_the_update():
    """Two runs whose dataset[0] differ wildly (same seed, noise included) take bit-identical
    steps as long as example 0 is not drawn: its copies as padding rows change nothing."""
    plain = private_run("truncated-poisson", seed=7)  # seed 7 draws example 0 late, if at all
    adversarial = private_run("truncated-poisson", data=adversarial_dataset(), seed=7)
    padded_steps = 0
    for _ in range(18):
        drawn = []
        for private in (plain, adversarial):
            x, y = next(iter(private.loader))
            private.optimizer.zero_grad()
            backward(private, (x, y))
            private.optimizer.step()
            drawn.append((x, private.loader.provenance.current.padding))
        (x, padding), (x_adv, _) = drawn
        if bool((x_adv[: padding.real] == 1e4).any()):
            break  # example 0 itself was drawn: from here the runs may differ
        assert bool((x_adv[padding.real :] == 1e4).all()) and padding.padded > 0
        padded_steps += 1
        assert torch.equal(flat(plain.model), flat(adversarial.model))
    assert padded_steps >= 3


# -- the ledger --------------------------------------------------------------------------------
@every_sampler
def test_the_ledger_records_one_step_of_the_sampler_per_step(sampler):
    private = private_run(sampler)
    examples = []
    for count in range(1, 9):  # over an epoch's end (balls-in-bins: k = 6 batches per epoch)
        trained(private, 1)
        examples.append(private.loader.provenance.current.size)
        assert private.ledger.steps == count
    summary = private.ledger.summary()
    assert summary.steps == 8 and summary.assumptions_met
    assert {group.sampling.kind for group in summary.sampling} == {KINDS[sampler]}
    assert sum(group.steps for group in summary.sampling) == 8
    assert summary.examples_seen == sum(examples)  # examples, never padding rows
    if sampler == "truncated-poisson":
        assert sum(examples) < 8 * 54
    assert math.isfinite(private.ledger.epsilon())


def small_run(sampler: str, seed: int) -> dpfy.PrivateTraining:
    """N = 64, B = 3: some batches hold no example (an all-padding batch under truncation)."""
    extra = {"max_batch_size": 24} if sampler == "truncated-poisson" else {}
    return private_run(sampler, data=dataset(n=64), batch_size=3, steps=21, seed=seed, **extra)


@pytest.mark.parametrize(("sampler", "seed"), [("truncated-poisson", 1), ("balls-in-bins", 5)])
def test_an_empty_batch_is_a_noise_only_step_and_is_accounted(sampler, seed):
    private = small_run(sampler, seed)
    silent = small_run(sampler, seed)
    silent.optimizer.noise = NoNoise()
    taken = 0
    for _ in range(21):
        taken += 1
        moved = []
        for run in (private, silent):
            x, y = next(iter(run.loader))
            before = flat(run.model)
            run.optimizer.zero_grad()
            backward(run, (x, y))
            run.optimizer.step()
            moved.append(not torch.equal(before, flat(run.model)))
        drawn = private.loader.provenance.current
        if drawn.size == 0:
            break
    else:
        raise AssertionError("no empty batch was drawn")
    if sampler == "truncated-poisson":
        assert x.shape[0] == 24 and drawn.padding.real == 0  # 24 padding rows, no example
    assert moved == [True, False]  # noise only: without noise nothing moves
    assert private.ledger.steps == silent.ledger.steps == taken
    kinds = {group.sampling.kind for group in private.ledger.summary().sampling}
    assert kinds == {KINDS[sampler]}


# -- checkpoints -------------------------------------------------------------------------------
@every_sampler
def test_a_checkpoint_resumes_the_same_batches_and_spends_the_same(sampler, tmp_path):
    whole = private_run(sampler)
    trained(whole, 4)  # balls-in-bins: k = 6 batches per epoch, so the resume is mid-epoch
    path = whole.save(tmp_path / "run.pt")
    rest = trained(whole, 5)  # across the epoch boundary
    resumed = private_run(sampler, seed=11)  # another seed: the checkpoint decides the stream
    resumed.load(path)
    again = trained(resumed, 5)
    for a, b in zip(rest, again, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert resumed.ledger.steps == whole.ledger.steps == 9
    assert resumed.ledger.epsilon() == pytest.approx(whole.ledger.epsilon(), rel=1e-12)


@every_sampler
def test_a_checkpoint_taken_mid_batch_resumes_on_that_batch(sampler):
    private = private_run(sampler)
    trained(private, 2)
    batch = next(iter(private.loader))  # in hand, not stepped on
    state = private.state_dict()
    resumed = private_run(sampler)
    resumed.load_state_dict(state)
    again = next(iter(resumed.loader))
    assert all(torch.equal(a, b) for a, b in zip(batch, again, strict=True))
    if sampler == "truncated-poisson":
        held = private.loader.provenance.current.padding
        assert resumed.loader.provenance.current.padding == held


@every_sampler
def test_a_skipped_batch_is_refused(sampler):
    private = private_run(sampler)
    batches = iter(private.loader)
    next(batches)  # drawn, looked at, never stepped on: a data-dependent skip
    backward(private, next(batches))
    assert_refused_unchanged(private, "skipped")


def test_the_refusals_name_batch_refused():
    """The provenance refusals are BatchRefused (a ValueError): one type callers can catch."""
    private = private_run("balls-in-bins")
    batch = next(iter(private.loader))
    backward(private, batch)
    private.optimizer.step()
    backward(private, batch)
    with pytest.raises(BatchRefused):
        private.optimizer.step()


@pytest.mark.parametrize("sampler", ["truncated-poisson", "balls-in-bins"])
def test_going_back_to_an_earlier_checkpoint_charges_the_steps_released_again(sampler, tmp_path):
    """Steps released, then rewound and taken again on the same batches, are released twice:
    the ε after the second release must exceed what the first had spent (under Poisson each
    step is charged, so it does)."""
    private = private_run(sampler)
    trained(private, 2)
    path = private.save(tmp_path / "early.pt")
    first = trained(private, 3)
    spent = private.epsilon()
    private.load(path)
    assert private.epsilon() >= spent * (1 - 1e-9)  # what was released still counts ...
    again = trained(private, 3)
    for a, b in zip(first, again, strict=True):  # ... and the same batches are released again
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert private.epsilon() > spent * (1 + 1e-6)


def test_going_back_to_an_epoch_boundary_of_balls_in_bins_charges_two_gaussians_per_epoch(
    tmp_path,
):
    """A checkpoint at an epoch's start, the run two steps into that epoch: the resumed run
    draws that epoch's assignment again, so the load charges two Gaussians of σ for it (a
    second release of one assignment is not covered by a second random-allocation charge);
    going back within the epoch reached charges nothing more than that epoch."""
    private = private_run("balls-in-bins")
    k = private.plan.sampling_record().batches_per_epoch
    trained(private, k)
    path = private.save(tmp_path / "boundary.pt")
    trained(private, 2)
    private.load(path)
    replayed = [
        entry
        for entry in private.ledger.state_dict()["entries"]
        if "released again" in entry["label"]
    ]
    assert [entry["count"] for entry in replayed] == [1]  # one epoch: SelfComposed(G, 2) once
