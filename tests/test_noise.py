"""TorchNoise's generators: one per device, seeded reproducibly, saved and restored."""

from __future__ import annotations

import torch

from dpfy.train.noise.source import TorchNoise, device_seed


def test_cpu_noise_is_the_seeded_cpu_generators_stream():
    """The CPU stream is torch's own from the seed: earlier seeded runs and checkpoints hold."""
    drawn = TorchNoise(seed=17).normal(torch.empty(3, 50), 0.5)
    expected = torch.empty(3, 50).normal_(0.0, 0.5, generator=torch.Generator().manual_seed(17))
    torch.testing.assert_close(drawn, expected, rtol=0, atol=0)


def test_each_device_gets_its_own_reproducible_seed():
    seeds = {device_seed(seed, name) for seed in (0, 1, -1) for name in ("cuda:0", "cuda:1")}
    assert len(seeds) == 6
    assert device_seed(5, "cuda:0") == device_seed(5, "cuda:0")
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_unseeded_sources_draw_different_noise():
    like = torch.empty(100)
    assert not torch.equal(TorchNoise().normal(like, 1.0), TorchNoise().normal(like, 1.0))


def test_state_round_trip_continues_the_stream_and_reads_the_older_format():
    source = TorchNoise(seed=2)
    source.normal(torch.empty(10), 1.0)
    saved = source.state_dict()
    assert saved["devices"] == {}  # no other device drew yet
    expected = source.normal(torch.empty(10), 1.0)
    for state in (saved, {"generator": saved["generator"]}):  # the format before "devices"
        restored = TorchNoise(seed=123)
        restored.load_state_dict(state)
        torch.testing.assert_close(restored.normal(torch.empty(10), 1.0), expected, rtol=0, atol=0)
