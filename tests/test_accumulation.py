"""Gradient accumulation: one loader batch over several backward passes is one exact step.

``optimizer.accumulate()`` after each backward pass but the last, ``optimizer.step()`` after the
last: the step equals the one the whole batch takes (per-example clipping, noise once, ÷ the
expected batch size, one ledger entry), and every misuse is refused with nothing changed.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.coupling import ExamplesCoupled
from dpfy.data.provenance import BatchRefused


class ZeroNoise:
    """Adds nothing: the update is the clipped average alone."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def data(n: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=generator) * 3, torch.arange(n) % 3)


def run(net: nn.Module | None = None, **options) -> dpfy.PrivateTraining:
    net = model() if net is None else net
    settings = dict(
        batch_size=16, delta=1e-5, max_grad_norm=0.5, noise_multiplier=1.0, steps=6, seed=3
    )
    settings.update(options)
    return dpfy.make_private(net, torch.optim.SGD(net.parameters(), lr=0.5), data(), **settings)


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def backward(private: dpfy.PrivateTraining, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(private.model(x), y).backward()


def pieces(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` consecutive pieces, some possibly empty."""
    cuts = [round(i * n / parts) for i in range(parts + 1)]
    return list(itertools.pairwise(cuts))


def train_split(private: dpfy.PrivateTraining, parts: int) -> list[int]:
    sizes = []
    for x, y in private.loader:
        sizes.append(len(x))
        private.optimizer.zero_grad()
        for i, (start, stop) in enumerate(pieces(len(x), parts)):
            backward(private, x[start:stop], y[start:stop])
            if i < parts - 1:
                private.optimizer.accumulate()
        private.optimizer.step()
    return sizes


def train_whole(private: dpfy.PrivateTraining) -> None:
    for x, y in private.loader:
        private.optimizer.zero_grad()
        backward(private, x, y)
        private.optimizer.step()


@pytest.mark.parametrize("engine", ["fast", "vmap"])
def test_a_batch_fed_in_pieces_with_accumulate_takes_the_whole_batch_step(engine):
    whole, split = run(engine=engine), run(engine=engine)
    whole.optimizer.noise = split.optimizer.noise = ZeroNoise()
    train_whole(whole)
    sizes = train_split(split, 3)
    assert max(sizes) > 3  # the pieces were real splits
    torch.testing.assert_close(flat(split.model), flat(whole.model), rtol=1e-5, atol=1e-6)
    assert not torch.equal(flat(split.model), flat(model()))  # it trained
    assert split.ledger.steps == whole.ledger.steps == 6  # one step per loader batch
    assert split.epsilon() == whole.epsilon()


def test_noise_is_drawn_once_per_step_at_sigma_c_over_b_however_many_pieces():
    # A loss that reaches no example: the update is the noise alone, lr·σC/B per coordinate
    # (noise per piece would give √3 times that, noise ÷ realised size another value).
    torch.manual_seed(0)
    net = nn.Linear(300, 200)
    x = torch.randn(64, 300)
    dataset = TensorDataset(x, torch.zeros(64))
    private = dpfy.make_private(
        net, torch.optim.SGD(net.parameters(), lr=1.0), dataset, batch_size=32, delta=1e-5,
        max_grad_norm=2.0, noise_multiplier=1.5, steps=1, seed=4,
    )  # fmt: skip
    before = flat(private.model)
    for xb, _ in private.loader:
        for i, (start, stop) in enumerate(pieces(len(xb), 3)):
            (private.model(xb[start:stop]) * 0.0).sum().backward()
            if i < 2:
                private.optimizer.accumulate()
        private.optimizer.step()
    update = flat(private.model) - before
    expected = 1.5 * 2.0 / 32
    assert update.numel() > 60_000
    assert abs(float(update.std()) / expected - 1) < 0.03
    assert private.ledger.steps == 1


def test_a_batch_split_over_two_backward_passes_without_accumulate_is_named_as_such():
    private = run(engine="fast")
    before = flat(private.model)
    x, y = next(iter(private.loader))
    backward(private, x[: len(x) // 2], y[: len(x) // 2])
    backward(private, x[len(x) // 2 :], y[len(x) // 2 :])
    with pytest.raises(BatchRefused, match=r"accumulate\(\) between them") as err:
        private.optimizer.step()
    assert "one forward pass" not in str(err.value).split("(")[0]
    assert torch.equal(flat(private.model), before) and private.ledger.steps == 0


def test_two_halves_without_accumulate_are_refused_under_vmap_too():
    # vmap pairs row i of each half as one "example": the count no longer matches the batch.
    private = run(engine="vmap")
    x, y = next(iter(private.loader))
    half = len(x) // 2
    backward(private, x[:half], y[:half])
    backward(private, x[half : 2 * half], y[half : 2 * half])
    with pytest.raises(BatchRefused, match=r"accumulate\(\)"):
        private.optimizer.step()
    assert private.ledger.steps == 0


def test_a_forward_pass_without_backward_before_the_step_is_not_mistaken_for_a_split():
    private = run()
    x, y = next(iter(private.loader))
    backward(private, x, y)
    private.model(x).sum()  # e.g. a metric computed with gradients on; never backpropagated
    private.optimizer.step()
    assert private.ledger.steps == 1


def test_pieces_of_two_loader_batches_cannot_form_one_step():
    private = run()
    before = flat(private.model)
    batches = iter(private.loader)
    x, y = next(batches)
    backward(private, x, y)
    private.optimizer.accumulate()
    x2, y2 = next(batches)
    backward(private, x2, y2)
    with pytest.raises(BatchRefused, match="two loader batches"):
        private.optimizer.step()
    assert torch.equal(flat(private.model), before) and private.ledger.steps == 0


def test_accumulating_only_part_of_the_batch_is_refused_at_the_step():
    private = run()
    x, y = next(iter(private.loader))
    backward(private, x[:2], y[:2])
    private.optimizer.accumulate()
    with pytest.raises(BatchRefused, match="drew a batch of"):
        private.optimizer.step()
    assert private.ledger.steps == 0


def test_a_microbatch_clipped_batch_cut_by_hand_is_refused():
    private = run(microbatch_size=2, batch_size=16)
    x, y = next(iter(private.loader))
    backward(private, x[:4], y[:4])
    with pytest.raises(BatchRefused, match="max_physical_batch_size"):
        private.optimizer.accumulate()


def test_chunks_of_the_private_loader_may_also_be_accumulated_by_hand():
    # The loader's chunks with accumulate() after each but the last, step() after the last.
    whole, chunked = run(), run(max_physical_batch_size=5)
    whole.optimizer.noise = chunked.optimizer.noise = ZeroNoise()
    train_whole(whole)
    for x, y in chunked.loader:
        backward(chunked, x, y)
        if chunked.optimizer.boundary.closes_batch:
            chunked.optimizer.step()
        else:
            chunked.optimizer.accumulate()
    torch.testing.assert_close(flat(chunked.model), flat(whole.model), rtol=1e-5, atol=1e-6)
    assert chunked.ledger.steps == 6


class Centre(nn.Module):
    """h − mean over the batch: couples the examples."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True)


def test_a_coupled_model_is_still_refused_when_its_batch_comes_in_pieces():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), Centre(), nn.Linear(8, 3))
    private = run(net)
    before = flat(private.model)
    x, y = next(iter(private.loader))
    with pytest.raises(ExamplesCoupled):
        for i, (start, stop) in enumerate(pieces(len(x), 2)):
            backward(private, x[start:stop], y[start:stop])
            if i == 0:
                private.optimizer.accumulate()
        private.optimizer.step()
    assert torch.equal(flat(private.model), before) and private.ledger.steps == 0


def test_detach_removes_the_accumulation_hook():
    private = run()
    net = private.detach()
    assert not net._forward_pre_hooks


def test_zero_grad_between_the_forward_and_backward_pass_keeps_the_step_exact():
    # Lightning's closure: forward, then optimizer.zero_grad(), then backward.
    usual, lightning_order = run(), run()
    usual.optimizer.noise = lightning_order.optimizer.noise = ZeroNoise()
    train_whole(usual)
    for x, y in lightning_order.loader:
        loss = nn.functional.cross_entropy(lightning_order.model(x), y)
        lightning_order.optimizer.zero_grad()
        loss.backward()
        lightning_order.optimizer.step()
    torch.testing.assert_close(flat(lightning_order.model), flat(usual.model), rtol=0, atol=0)


def test_accumulate_on_the_closing_chunk_then_step_keeps_microbatch_units_exact():
    # accumulate() after every chunk (the last included), then step() with nothing left to clip.
    usual = run(microbatch_size=2, max_physical_batch_size=5)
    late = run(microbatch_size=2, max_physical_batch_size=5)
    usual.optimizer.noise = late.optimizer.noise = ZeroNoise()
    for x, y in usual.loader:
        backward(usual, x, y)
        usual.optimizer.step()
    for x, y in late.loader:
        backward(late, x, y)
        late.optimizer.accumulate()
        if late.optimizer.boundary.closes_batch:
            late.optimizer.step()
    torch.testing.assert_close(flat(late.model), flat(usual.model), rtol=1e-6, atol=1e-7)
    assert late.ledger.steps == usual.ledger.steps == 6


def test_a_padded_truncated_poisson_batch_cut_by_hand_is_refused():
    private = run(sampler="truncated-poisson", max_batch_size=48)
    x, y = next(iter(private.loader))
    backward(private, x[:4], y[:4])
    with pytest.raises(BatchRefused, match="padded to a static shape"):
        private.optimizer.accumulate()
    assert private.ledger.steps == 0


def test_a_backward_through_a_forward_whose_captures_were_dropped_is_refused_by_name():
    # Both pieces' forwards first, then their backwards: accumulate() after the first backward
    # drops the second forward's captures, so its examples could not be clipped.
    private = run()
    before = flat(private.model)
    x, y = next(iter(private.loader))
    half = len(x) // 2
    first = nn.functional.cross_entropy(private.model(x[:half]), y[:half])
    second = nn.functional.cross_entropy(private.model(x[half:]), y[half:])
    first.backward()
    private.optimizer.accumulate()
    with pytest.raises(BatchRefused, match="already dropped"):
        second.backward()
    assert private.ledger.steps == 0 and torch.equal(flat(private.model), before)
