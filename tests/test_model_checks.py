"""Batch-coupled layers are refused before training, and fix() replaces exactly those."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.train.checks import check_model, find_batch_coupled_layers, fix, fix_model

REFUSED = [
    lambda: nn.BatchNorm1d(8),
    lambda: nn.BatchNorm2d(8),
    lambda: nn.BatchNorm3d(8),
    lambda: nn.BatchNorm2d(8, affine=False, track_running_stats=False),
    lambda: nn.SyncBatchNorm(8),
    lambda: nn.LazyBatchNorm2d(),
    lambda: nn.InstanceNorm1d(8, track_running_stats=True),
    lambda: nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
    lambda: nn.InstanceNorm3d(8, track_running_stats=True),
    lambda: nn.LazyInstanceNorm2d(track_running_stats=True),
]

SAFE = [
    lambda: nn.GroupNorm(4, 8),
    lambda: nn.LayerNorm(8),
    lambda: nn.InstanceNorm2d(8),
    lambda: nn.InstanceNorm1d(8, affine=True),
]


@pytest.mark.parametrize("build", REFUSED)
def test_each_batch_coupled_layer_is_refused_with_the_reason_and_the_fix(build):
    layer = build()
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Sequential(layer), nn.ReLU())
    with pytest.raises(ValueError) as refused:
        check_model(model)
    message = str(refused.value)
    assert "1.0" in message and type(layer).__name__ in message  # the path and the layer type
    assert "§5.5.1" in message and "dpfy.fix(model)" in message
    (finding,) = check_model(model, strict=False)
    assert finding.path == "1.0" and finding.layer == type(layer).__name__


@pytest.mark.parametrize("build", SAFE)
def test_per_example_layers_pass(build):
    model = nn.Sequential(nn.Linear(8, 8), build())
    assert check_model(model) == ()


def test_every_offender_is_listed_in_one_error():
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match=r"2 layer\(s\)") as refused:
        check_model(model)
    assert "  - 0 (BatchNorm1d)" in str(refused.value) and "  - 2 (BatchNorm1d)" in str(
        refused.value
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 48, 3, padding=1),
            nn.BatchNorm2d(48),
            nn.ReLU(),
            nn.Conv2d(48, 10, 3, padding=1),
            nn.InstanceNorm2d(10, affine=True, track_running_stats=True),
        )
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, 5)
        self.bn_head = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean(dim=(2, 3))
        return self.bn_head(self.head(self.norm(x)))


def test_fix_replaces_only_the_offenders_and_the_model_runs_per_example():
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.features[1].weight.uniform_()
        model.features[4].bias.uniform_()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="replaced 3 layer"):
        fixed = fix(model)

    assert find_batch_coupled_layers(fixed) == ()
    bn = fixed.features[1]
    assert type(bn) is nn.GroupNorm and bn.num_groups == 16 and bn.num_channels == 48
    assert torch.equal(bn.weight, original["features.1.weight"])  # affine parameters kept
    inorm = fixed.features[4]
    assert type(inorm) is nn.InstanceNorm2d and not inorm.track_running_stats and inorm.affine
    assert torch.equal(inorm.bias, original["features.4.bias"])
    assert type(fixed.bn_head) is nn.GroupNorm and fixed.bn_head.num_groups == 1

    # nothing else changed, and the caller's model is untouched
    for name, value in fixed.state_dict().items():
        if not name.startswith(("features.1.", "features.4.", "bn_head.")):
            assert torch.equal(value, original[name]), name
    assert type(model.features[1]) is nn.BatchNorm2d
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())

    # forward runs, and each example's output no longer depends on the rest of the batch
    fixed.train()
    batch = torch.randn(4, 3, 6, 6)
    together = fixed(batch)
    alone = torch.cat([fixed(batch[i : i + 1]) for i in range(4)])
    assert together.shape == (4, 5)
    torch.testing.assert_close(together, alone)
    together.sum().backward()
    assert all(p.grad is not None for p in fixed.parameters())


def test_fix_in_place_and_report_of_replacements():
    model = nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64))
    fixed, replacements = fix_model(model, inplace=True)
    assert fixed is model and type(model[1]) is nn.GroupNorm and model[1].num_groups == 32
    (replacement,) = replacements
    assert replacement.path == "1" and "BatchNorm1d" in replacement.before
    assert "GroupNorm(32, 64" in replacement.after
    assert fix_model(model)[1] == ()  # nothing left to replace


def test_fix_handles_root_shared_sync_and_lazy_layers():
    root = fix_model(nn.BatchNorm2d(6))[0]
    assert type(root) is nn.GroupNorm and root.num_groups == 2

    shared = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), shared, nn.Linear(4, 4), shared)
    fixed, replacements = fix_model(model)
    assert len(replacements) == 1 and fixed[1] is fixed[3] and type(fixed[1]) is nn.GroupNorm

    sync = fix_model(nn.Sequential(nn.SyncBatchNorm(12, affine=False)))[0]
    assert type(sync[0]) is nn.GroupNorm and not sync[0].affine and sync[0].num_groups == 4

    lazy = nn.Sequential(nn.Conv2d(3, 5, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match="forward pass"):
        fix_model(lazy)
    lazy(torch.randn(2, 3, 4, 4))  # materialises the lazy layer as BatchNorm2d(5)
    assert type(fix_model(lazy)[0][1]) is nn.GroupNorm


def test_fix_keeps_dtype_and_training_mode():
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8)).double().eval()
    fixed = fix_model(model)[0]
    assert fixed[1].weight.dtype == torch.float64 and not fixed[1].training
    assert fixed(torch.randn(2, 3, dtype=torch.float64)).dtype == torch.float64


def test_non_modules_are_refused():
    with pytest.raises(ValueError, match=r"nn\.Module"):
        check_model("resnet")
