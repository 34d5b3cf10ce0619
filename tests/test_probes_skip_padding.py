"""The behaviour probes follow examples, never a truncated Poisson batch's padding rows.

A padded batch has M rows, its last ones copies of ``dataset[0]`` weighted 0 in the step. The
model, loss and collate probes must draw the rows they follow among the examples (never the
first or last example for the model probe), tally only probes of examples (a batch of fewer
than two examples is skipped, as a small Poisson batch is), and still refuse a coupling among
the examples.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, _utils

import dpfy
from dpfy import CheckSchedule, ExamplesCoupled
from dpfy.data import collate_probe
from dpfy.data.collate_probe import SKIPPED, LastDrawn, ProbingCollate
from dpfy.data.padding import Padding
from dpfy.train.behaviour import loss_probe
from dpfy.train.behaviour.example_rows import ExampleRows
from dpfy.train.behaviour.model_probe import ModelProbe

N, D, K, M, STEPS = 64, 6, 3, 21, 10


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g))


def _mlp(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), *middle, nn.Tanh(), nn.Linear(8, K))


def _private(model: nn.Module, data=None, **kwargs):
    """B = 3 of N = 64 padded to M = 21: seed 0 draws 3, 3, 2, 1, 4, 1, 2, 9, 0, 2 examples."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    private = dpfy.make_private(
        model, optimizer, _data() if data is None else data, batch_size=3, steps=STEPS,
        noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, seed=0,
        sampler="truncated-poisson", max_batch_size=M,
        behaviour_checks=CheckSchedule(first=STEPS, every=None), **kwargs,
    )  # fmt: skip
    assert isinstance(private.loader.collate_fn.padding, LastDrawn)  # the loader wires it
    return private


def _train(private, loss_fn) -> list[int]:
    """Every step of the run; the examples of each batch."""
    reals = []
    for x, y in private.loader:
        assert x.shape[0] == M
        private.optimizer.zero_grad()
        loss_fn(private.model(x), y).backward()
        private.optimizer.step()
        reals.append(private.loader.provenance.current.padding.real)
    return reals


@pytest.fixture
def chosen(monkeypatch):
    """Every row each probe chose, with the examples of the batch it was chosen in."""
    seen: dict[str, list[tuple[int, int]]] = {"model": [], "loss": [], "collate": []}
    state = {"loader": None}

    def real() -> int:
        return state["loader"].provenance.current.padding.real

    original = ModelProbe._probed_rows

    def model_rows(self, examples):
        rows = original(self, examples)
        seen["model"] += [(int(r), real()) for r in rows]
        return rows

    def loss_take(tree, size, index, *args):
        if isinstance(tree, torch.Tensor):  # the output's row (then the targets' and kwargs')
            seen["loss"].append((int(index), real()))
        return take_rows(tree, size, index, *args)

    take_rows = loss_probe.take_rows
    monkeypatch.setattr(ModelProbe, "_probed_rows", model_rows)
    monkeypatch.setattr(loss_probe, "take_rows", loss_take)
    collate_take = collate_probe.take_rows

    def collate_rows(batch, size, index, *args):
        # collated in the main process: the sampler's last draw is this batch
        seen["collate"].append((int(index), state["sampler"].padding(state["sampler"].position)))
        return collate_take(batch, size, index, *args)

    monkeypatch.setattr(collate_probe, "take_rows", collate_rows)

    def attach(private):
        state["loader"] = private.loader
        state["sampler"] = private.loader.dp_sampler
        return seen

    return attach


def test_no_probe_ever_follows_a_padding_row(chosen):
    private = _private(_mlp(), criterion=nn.CrossEntropyLoss())
    seen = chosen(private)
    reals = _train(private, private.criterion)
    assert sorted(reals) != reals and min(reals) == 0  # small, large and empty batches
    assert seen["model"] and seen["loss"] and seen["collate"]
    for row, real in seen["model"]:
        assert row < real, "the model probe followed a padding row"
        assert real < 3 or 1 <= row <= real - 2, "the first or last example was probed"
    for row, real in seen["loss"]:
        assert row < real, "the loss probe compared a padding row"
    for row, padding in seen["collate"]:
        assert row < padding.real, "the collate probe collated a padding row alone"


def test_the_card_tallies_only_probes_of_examples():
    private = _private(_mlp(), criterion=nn.CrossEntropyLoss())
    reals = _train(private, private.criterion)
    probed = sum(r >= 2 for r in reals)
    assert 0 < probed < STEPS  # some batches hold fewer than two examples (M = 21 rows each)
    summary = private.optimizer.behaviour.summary()
    for check in ("model", "loss", "collate"):
        assert summary[check]["status"] == "passed"
        assert summary[check]["probes"] == probed, check
        assert "fewer than two examples" in summary[check]["detail"]


def test_the_loader_wires_the_collate_probe_to_the_padding():
    loader = dpfy.data.loader.DPDataLoader(
        _data(), 3, steps=2, sampler="truncated-poisson", max_batch_size=M,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert isinstance(loader.collate_fn.padding, LastDrawn)


def test_an_all_padding_batch_probes_nothing_and_is_a_noise_only_step(chosen):
    """An empty batch (M padding rows): no probe follows a row, each skips it as a batch of
    fewer than two examples, and the step is taken (noise only) and accounted."""
    private = _private(_mlp(), criterion=nn.CrossEntropyLoss())
    seen = chosen(private)
    reals, empty = [], None
    for x, y in private.loader:
        real = private.loader.provenance.current.padding.real
        rows_before = sum(len(v) for v in seen.values())
        before = [p.detach().clone() for p in private.model.parameters()]
        private.optimizer.zero_grad()
        private.criterion(private.model(x), y).backward()
        private.optimizer.step()
        reals.append(real)
        if real == 0:
            empty = sum(len(v) for v in seen.values()) - rows_before
            after = list(private.model.parameters())
            moved = [not torch.equal(a, b) for a, b in zip(before, after, strict=True)]
            break
    assert reals[-1] == 0 and empty == 0, "a probe followed a row of the all-padding batch"
    assert any(moved)  # the noise moved the model: the step was taken
    assert private.ledger.steps == len(reals)  # and accounted
    summary = private.optimizer.behaviour.summary()
    for check in ("model", "loss", "collate"):
        assert summary[check]["probes"] == sum(r >= 2 for r in reals), check


# -- a coupling among the examples is still refused ---------------------------------------------
class Centre(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0)


def _mixup_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    perm = torch.arange(len(y)).roll(1)
    return 0.7 * F.cross_entropy(out, y) + 0.3 * F.cross_entropy(out, y[perm])


def _standardising_collate(samples):
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return (x - x.mean(0)) / (x.std(0) + 1e-6), y


def _refused_on_a_padded_batch(private, loss_fn, match: str) -> None:
    steps = private.ledger.steps
    before = {k: v.clone() for k, v in private.model.state_dict().items()}
    with pytest.raises(ExamplesCoupled, match=match):
        _train(private, loss_fn)
    padding = private.loader.provenance.current.padding
    assert padding.real >= 2 and padding.rows == M  # refused on a padded batch of examples
    assert all(torch.equal(before[k], v) for k, v in private.model.state_dict().items())
    assert private.ledger.steps == steps


def test_a_coupled_model_is_still_refused_on_padded_batches():
    private = _private(_mlp(Centre()))
    _refused_on_a_padded_batch(private, F.cross_entropy, "the model")


def test_a_coupled_loss_is_still_refused_on_padded_batches():
    private = _private(_mlp(), criterion=_mixup_loss)
    _refused_on_a_padded_batch(private, private.criterion, "the loss")


def test_a_coupled_collate_fn_is_still_refused_on_padded_batches():
    loader = DataLoader(_data(), batch_size=3, collate_fn=_standardising_collate)
    private = _private(_mlp(), loader)
    _refused_on_a_padded_batch(private, F.cross_entropy, "collate_fn")


# -- the pieces ---------------------------------------------------------------------------------
def test_example_rows_follow_the_chunk_in_hand():
    batch = type("Drawn", (), {"padding": Padding(10, 6)})()
    chunk: dict[str, tuple[int, int] | None] = {"span": None}
    rows = ExampleRows(lambda: batch, lambda: chunk["span"])
    assert rows(10) == 6
    assert rows(7) is None  # not the padded rows the loader handed out: not known
    chunk["span"] = (4, 8)
    assert rows(4) == 2
    chunk["span"] = (8, 10)
    assert rows(2) == 0
    plain = type("Drawn", (), {"padding": None})()
    assert ExampleRows(lambda: plain)(5) == 5


def test_a_worker_is_told_only_whether_batches_are_padded():
    """Pickled for a worker process: no sampler travels, and a padded batch collated there is
    stated as not probed (the worker cannot know its padding rows)."""

    class Sampler:  # padded batches, not picklable (a worker must never get it)
        position = 1

        def padding(self, position):
            return Padding(4, 2)

        def __reduce__(self):
            raise TypeError("the sampler must stay in the main process")

    schedule = CheckSchedule(first=5, every=None)
    padded = ProbingCollate(torch.stack, schedule, LastDrawn(Sampler()))
    probing = pickle.loads(pickle.dumps(padded))
    samples = [torch.full((2,), float(i)) for i in range(4)]
    assert probing.padding is not None
    _utils.worker._worker_info = object()  # as inside a worker process
    try:
        assert probing(samples).verdict[0] == SKIPPED
    finally:
        _utils.worker._worker_info = None
    unpadded = pickle.loads(pickle.dumps(ProbingCollate(torch.stack, schedule, lambda: None)))
    assert unpadded.padding is None and unpadded(samples).verdict[0] == "passed"


def test_under_virtual_batching_each_chunk_is_probed_among_its_own_examples(monkeypatch):
    """max_physical_batch_size cuts a padded batch into chunks: a chunk's examples are the
    batch's examples that fall in it (the last chunks may hold padding only)."""
    seen: list[tuple[int, int]] = []
    calls: list[int] = []
    original = ModelProbe._probed_rows
    private = _private(_mlp(), max_physical_batch_size=8)
    drawn = private.loader.provenance
    boundary = private.optimizer.boundary

    def model_rows(self, examples):
        start, stop = boundary.chunk
        in_chunk = drawn.current.padding.chunk(start, stop).real
        rows = original(self, examples)
        assert examples == in_chunk
        calls.append(in_chunk)
        seen.extend((int(r), in_chunk) for r in rows)
        return rows

    monkeypatch.setattr(ModelProbe, "_probed_rows", model_rows)
    chunks = 0
    for x, y in private.loader:
        assert x.shape[0] == (M - 16 if boundary.chunk[0] == 16 else 8)
        chunks += 1
        F.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
        private.optimizer.zero_grad()
    assert private.ledger.steps == STEPS and chunks == 3 * STEPS
    assert seen and all(row < real for row, real in seen)
    probes = private.optimizer.behaviour.summary()["model"]["probes"]
    assert probes == len(calls) < chunks  # chunks of fewer than two examples: skipped
