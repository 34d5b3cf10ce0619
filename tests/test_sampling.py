"""Samplers draw the way the accountant assumes, say what they did, and resume exactly."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from dpfy.data import (
    DPDataLoader,
    FixedSizeSampler,
    PoissonSampler,
    SamplingKind,
    SamplingRecord,
    ShuffleSampler,
    make_sampler,
)
from dpfy.data.loader import rest_of_run
from dpfy.data.randomness import _SCALE, _threshold
from dpfy.plan.accounting.events import FixedSizeSampledEvent, GaussianEvent, PoissonSampledEvent

# Statistical checks use bounds of Z standard deviations; with the fixed seeds below they pass,
# and a sampler with the wrong law (wrong q, fixed sizes, correlated inclusions) fails them.
Z = 5.0


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- Poisson law --------------------------------------------------------------------------------
def test_poisson_inclusion_frequency_matches_q_for_every_index():
    n, q, steps = 50, 0.2, 2000
    counts = torch.zeros(n)
    for batch in PoissonSampler(n, q, steps, gen(1)):
        counts[batch] += 1
    sd = math.sqrt(steps * q * (1 - q))
    assert (counts - steps * q).abs().max() < Z * sd


def test_poisson_batch_size_mean_and_variance_are_binomial():
    n, q, steps = 1000, 0.05, 2000
    sizes = torch.tensor([len(b) for b in PoissonSampler(n, q, steps, gen(2))], dtype=torch.float64)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean().item() - mean) < Z * math.sqrt(var / steps)
    # the sample variance has sd ≈ var·sqrt(2/(steps−1)) for near-normal data
    assert abs(sizes.var().item() - var) < Z * var * math.sqrt(2 / (steps - 1))


def test_poisson_batches_are_distinct_sorted_in_range_indices():
    for batch in PoissonSampler(100, 0.3, 50, gen(3)):
        assert batch == sorted(set(batch))
        assert all(0 <= i < 100 for i in batch)


def test_poisson_yields_empty_batches_and_exactly_steps_batches():
    sampler = PoissonSampler(10, 0.001, 100, gen(4))
    for _ in range(2):  # every pass has exactly `steps` batches
        batches = list(sampler)
        assert len(batches) == 100 == len(sampler)
        assert batches.count([]) > 90  # P(empty) = 0.999^10 ≈ 0.99


def test_rate_one_takes_everything_and_threshold_never_exceeds_q():
    assert all(b == list(range(7)) for b in PoissonSampler(7, 1.0, 3, gen()))
    for q in [1e-12, 1e-6, 0.001, 0.1, 1 / 3, 0.5, 0.7]:
        realised = _threshold(q) / _SCALE
        assert realised <= q
        assert q - realised < 2.0**-53


def test_q_comes_from_dataset_size_and_expected_batch_size():
    sampler = PoissonSampler.from_batch_size(1000, 10, steps=7, generator=gen())
    assert sampler.sampling_rate == 0.01
    assert sampler.expected_batch_size == pytest.approx(10)
    data = TensorDataset(torch.zeros(1000, 2))
    for kwargs in ({}, {"steps": 3}, {"epochs": 5}):
        loader = DPDataLoader(data, 10, generator=gen(), **kwargs)
        assert loader.sampling_rate == 0.01  # never 1 / len(loader)
    five = DPDataLoader(data, 10, epochs=5)
    assert len(five) == 100 == five.steps_per_epoch  # one iteration is one epoch
    assert (five.total_steps, five.epochs) == (500, 5)
    assert len(DPDataLoader(data, 10)) == 100 == DPDataLoader(data, 10).steps_per_epoch


def test_poisson_record_and_event():
    sampler = PoissonSampler(200, 0.05, 4, gen())
    record = sampler.record
    assert record.kind is SamplingKind.POISSON and record.assumption_met
    assert sampler.step_event(1.5) == PoissonSampledEvent(0.05, GaussianEvent(1.5))


def test_secure_source_is_poisson_too():
    n, q, steps = 40, 0.25, 800
    counts = torch.zeros(n)
    sampler = PoissonSampler(n, q, steps, secure=True)
    assert sampler.secure
    for batch in sampler:
        counts[batch] += 1
    assert (counts - steps * q).abs().max() < Z * math.sqrt(steps * q * (1 - q))
    with pytest.raises(ValueError, match="not both"):
        PoissonSampler(n, q, steps, gen(), secure=True)


# -- not Poisson, and saying so -----------------------------------------------------------------
def test_shuffle_sampler_covers_each_epoch_once_and_reports_an_unmet_assumption():
    sampler = ShuffleSampler(23, 5, steps=8, generator=gen(5))  # 4 batches per epoch, 3 dropped
    batches = list(sampler)
    assert [len(b) for b in batches] == [5] * 8
    for epoch in (batches[:4], batches[4:]):
        flat = [i for b in epoch for i in b]
        assert len(set(flat)) == 20
    record = sampler.record
    assert record.kind is SamplingKind.SHUFFLE and not record.assumption_met
    assert "NOT Poisson" in record.description
    # accounted as Poisson at q = B/N, flagged as an assumption not met
    assert sampler.step_event(1.0) == PoissonSampledEvent(5 / 23, GaussianEvent(1.0))


def test_fixed_size_sampler_reports_its_honest_event():
    sampler = FixedSizeSampler(30, 6, steps=50, generator=gen(6))
    for batch in sampler:
        assert len(batch) == len(set(batch)) == 6
    record = sampler.record
    assert record.kind is SamplingKind.FIXED_SIZE and record.assumption_met
    assert "NOT Poisson" in record.description
    assert sampler.step_event(2.0) == FixedSizeSampledEvent(30, 6, GaussianEvent(2.0))
    assert record.poisson_event(2.0) == PoissonSampledEvent(0.2, GaussianEvent(2.0))


def test_fixed_size_sampler_is_uniform():
    n, b, steps = 20, 4, 3000
    counts = torch.zeros(n)
    for batch in FixedSizeSampler(n, b, steps, gen(7)):
        counts[batch] += 1
    p = b / n
    assert (counts - steps * p).abs().max() < Z * math.sqrt(steps * p * (1 - p))


def test_sampling_record_validation_and_round_trip():
    record = SamplingRecord("fixed-size", 0.25, 8, 2)
    assert SamplingRecord.from_dict(record.to_dict()) == record
    with pytest.raises(ValueError, match="no fixed batch_size"):
        SamplingRecord("poisson", 0.1, 10, 1)
    with pytest.raises(ValueError, match="needs its fixed batch_size"):
        SamplingRecord("shuffle", 0.1, 10)
    with pytest.raises(ValueError, match="sampling must be one of"):
        SamplingRecord("random", 0.1, 10)


# -- resuming -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build",
    [
        lambda g: PoissonSampler(60, 0.1, 9, g),
        lambda g: ShuffleSampler(60, 7, 9, g),  # 8 batches per epoch: resume crosses an epoch
        lambda g: FixedSizeSampler(60, 7, 9, g),
    ],
)
def test_state_dict_resume_reproduces_the_continuation(build):
    reference = build(gen(11))
    expected = list(reference) + list(reference)  # two passes

    interrupted = build(gen(11))
    head = []
    for batch in interrupted:
        head.append(batch)
        if len(head) == 4:
            break
    state = interrupted.state_dict()

    resumed = build(gen(999))  # another seed: the state must override it
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 5  # the rest of the interrupted pass only
    assert head + rest + list(resumed) == expected


def test_state_after_a_full_pass_starts_the_next_pass():
    reference = PoissonSampler(30, 0.2, 4, gen(3))
    first, second = list(reference), list(reference)
    sampler = PoissonSampler(30, 0.2, 4, gen(3))
    assert list(sampler) == first
    resumed = PoissonSampler(30, 0.2, 4, gen(8))
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == second


def test_load_state_refuses_a_mismatched_or_corrupt_state_without_changing_anything():
    sampler = PoissonSampler(30, 0.2, 4, gen(3))
    before = sampler.state_dict()
    other = PoissonSampler(31, 0.2, 4, gen(3)).state_dict()
    with pytest.raises(ValueError, match="dataset_size"):
        sampler.load_state_dict(other)
    corrupt = dict(before, rng=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="corrupt sampler state"):
        sampler.load_state_dict(corrupt)
    with pytest.raises(ValueError, match="secure"):
        sampler.load_state_dict(dict(before, secure=True))
    after = sampler.state_dict()
    assert torch.equal(after["rng"], before["rng"]) and after["position"] == before["position"]
    assert list(sampler) == list(PoissonSampler(30, 0.2, 4, gen(3)))


def test_make_sampler_by_kind():
    assert isinstance(make_sampler("poisson", 10, 2, 3, gen()), PoissonSampler)
    assert isinstance(make_sampler("shuffle", 10, 2, 3, gen()), ShuffleSampler)
    assert isinstance(make_sampler("fixed_size", 10, 2, 3, gen()), FixedSizeSampler)


# -- the loader ---------------------------------------------------------------------------------
class DictDataset(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((2, 3), float(i)), "y": i, "name": f"ex{i}"}


def test_loader_yields_correctly_shaped_empty_batches():
    data = TensorDataset(torch.randn(20, 3, 4), torch.arange(20))
    loader = DPDataLoader(data, 1, steps=200, generator=gen(1))  # q = 0.05
    shapes = collections.Counter()
    for x, y in rest_of_run(loader):
        assert x.shape[1:] == (3, 4) and x.dtype == data.tensors[0].dtype
        assert y.shape == x.shape[:1] and y.dtype == torch.int64
        shapes[x.shape[0]] += 1
    assert shapes[0] > 0 and sum(shapes.values()) == 200

    dict_loader = DPDataLoader(DictDataset(), 1, steps=100, generator=gen(2))
    empty = [b for b in dict_loader if b["x"].shape[0] == 0]
    assert empty, "q = 1/12 over 100 steps gives empty batches"
    assert empty[0]["x"].shape == (0, 2, 3) and empty[0]["y"].shape == (0,)
    assert empty[0]["name"] == []


def test_loader_passes_a_full_batch_through_the_collate():
    data = TensorDataset(torch.arange(10.0).reshape(10, 1))
    (x,) = next(iter(DPDataLoader(data, 10, steps=1, generator=gen())))
    assert x.flatten().tolist() == list(range(10))  # q = 1: everything, in order


def test_loader_exposes_what_the_ledger_needs():
    data = TensorDataset(torch.zeros(100, 1))
    loader = DPDataLoader(data, 20, sampler="shuffle", generator=gen())
    assert loader.expected_batch_size == 20 and loader.steps_per_epoch == 5
    assert loader.sampling_record.kind is SamplingKind.SHUFFLE
    assert not loader.sampling_record.assumption_met
    assert loader.step_event(1.0) == PoissonSampledEvent(0.2, GaussianEvent(1.0))


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


@pytest.mark.parametrize(
    ("dataset", "batch_size", "match"),
    [
        (TensorDataset(torch.zeros(0, 2)), 1, "empty"),
        (TensorDataset(torch.zeros(5, 2)), 0, ">= 1"),
        (TensorDataset(torch.zeros(5, 2)), -3, ">= 1"),
        (TensorDataset(torch.zeros(5, 2)), 6, "exceeds the dataset size 5; lower batch_size"),
        (TensorDataset(torch.zeros(5, 2)), 2.5, ">= 1"),
        (Stream(), 1, "map-style"),
    ],
)
def test_loader_refuses_bad_inputs(dataset, batch_size, match):
    with pytest.raises(ValueError, match=match):
        DPDataLoader(dataset, batch_size)


def test_loader_refuses_options_it_owns():
    data = TensorDataset(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="shuffle"):
        DPDataLoader(data, 2, shuffle=True)
    with pytest.raises(ValueError, match="steps or epochs"):
        DPDataLoader(data, 2, steps=3, epochs=1)


def test_loader_checkpoint_counts_handed_out_batches_despite_worker_prefetch():
    data = TensorDataset(torch.arange(40))
    reference = [b[0].tolist() for b in DPDataLoader(data, 4, steps=12, generator=gen(5))]

    loader = DPDataLoader(data, 4, steps=12, generator=gen(5), num_workers=2, prefetch_factor=2)
    head = []
    for (batch,) in loader:
        head.append(batch.tolist())
        if len(head) == 3:
            state = loader.state_dict()  # workers have drawn more than 3 batches by now
            break
    assert loader.dp_sampler.position > 3
    resumed = DPDataLoader(data, 4, steps=12, generator=gen(6))
    resumed.load_state_dict(state)
    rest = [b[0].tolist() for b in resumed]
    assert head + rest == reference


def test_a_secure_shuffle_resumes_the_rest_of_its_epoch():
    sampler = ShuffleSampler(20, 5, steps=4, secure=True)
    iterator = iter(sampler)
    head = [next(iterator), next(iterator)]
    resumed = ShuffleSampler(20, 5, steps=4, secure=True)
    resumed.load_state_dict(sampler.state_dict())
    rest = list(resumed)
    assert len(rest) == 2
    assert sorted(i for b in head + rest for i in b) == list(range(20))
    with pytest.raises(ValueError, match="secure"):
        ShuffleSampler(20, 5, steps=4, generator=gen()).load_state_dict(sampler.state_dict())
