"""Empty Poisson batches: every fast-engine rule takes B = 0, a noise-only step that is accounted.

Poisson sampling draws an empty batch now and then (often, at small q); DP-SGD still takes the
step — noise only — and the ledger counts it. These tests go over the rule registry itself, so a
newly registered layer type fails here until it has an example below.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import dpfy
from dpfy.cli.app import app
from dpfy.data.loader import rest_of_run
from dpfy.train.grads import find_rule, make_engine, registered_layers
from dpfy.train.grads.capture import Call, output_tensors
from dpfy.train.grads.substitutions import (
    EmptyBatchInstanceNorm1d,
    EmptyBatchInstanceNorm2d,
    EmptyBatchInstanceNorm3d,
    InProjection,
)

SIGMA, CLIP, BATCH, CLASSES = 2.0, 1.0, 2.0, 7


class Attention(nn.Module):
    """Self-attention as a layer of its own (the engines watch its InProjection substitute)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class Recurrent(nn.Module):
    """A recurrent layer's output sequence (it returns the sequence and the final state)."""

    def __init__(self, cls: type[nn.RNNBase]) -> None:
        super().__init__()
        self.rnn = cls(6, 4, num_layers=2, bidirectional=True, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.rnn(x)[0]


#: For each registered layer type: a model part that contains it, and one example's input shape
#: (an int first entry: integer indices below it).
EXAMPLES: dict[type[nn.Module], Callable[[], tuple[nn.Module, tuple[int, ...]]]] = {
    nn.Linear: lambda: (nn.Linear(6, 6), (4, 6)),
    nn.Conv1d: lambda: (nn.Conv1d(3, 6, 3, padding=1), (3, 8)),
    nn.Conv2d: lambda: (nn.Conv2d(3, 6, 3, padding=1), (3, 6, 6)),
    nn.Embedding: lambda: (nn.Embedding(20, 6), (5,)),
    nn.LayerNorm: lambda: (nn.LayerNorm(6), (4, 6)),
    nn.RMSNorm: lambda: (nn.RMSNorm(6), (4, 6)),
    nn.GroupNorm: lambda: (nn.GroupNorm(2, 6), (6, 4, 4)),
    nn.InstanceNorm1d: lambda: (nn.InstanceNorm1d(6, affine=True), (6, 8)),
    nn.InstanceNorm2d: lambda: (nn.InstanceNorm2d(6, affine=True), (6, 4, 4)),
    nn.InstanceNorm3d: lambda: (nn.InstanceNorm3d(6, affine=True), (6, 2, 3, 3)),
    EmptyBatchInstanceNorm1d: lambda: (EmptyBatchInstanceNorm1d(6, affine=True), (6, 8)),
    EmptyBatchInstanceNorm2d: lambda: (EmptyBatchInstanceNorm2d(6, affine=True), (6, 4, 4)),
    EmptyBatchInstanceNorm3d: lambda: (EmptyBatchInstanceNorm3d(6, affine=True), (6, 2, 3, 3)),
    InProjection: lambda: (Attention(), (4, 6)),
    nn.RNN: lambda: (Recurrent(nn.RNN), (4, 6)),
    nn.GRU: lambda: (Recurrent(nn.GRU), (4, 6)),
    nn.LSTM: lambda: (Recurrent(nn.LSTM), (4, 6)),
}

LAYERS = list(registered_layers())


class Probe(nn.Module):
    """The layer under test, then a Linear head to class logits (the head gets noise too)."""

    def __init__(self, layer: nn.Module, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.layer = layer
        self.indices = isinstance(layer, nn.Embedding)
        with torch.no_grad():
            width = layer(_inputs(self, 1, shape)).flatten(1).shape[1]
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x).flatten(1))


def _inputs(probe: Probe, n: int, shape: tuple[int, ...], seed: int = 0) -> Tensor:
    """n examples for the probe's layer: indices for an embedding, floats otherwise."""
    generator = torch.Generator().manual_seed(seed)
    if probe.indices:
        return torch.randint(0, 20, (n, *shape), generator=generator)
    return torch.randn((n, *shape), generator=generator)


def _probe(layer_type: type[nn.Module]) -> tuple[Probe, tuple[int, ...]]:
    """A seeded probe model around the registered type's example."""
    torch.manual_seed(0)
    layer, shape = EXAMPLES[layer_type]()
    return Probe(layer, shape), shape


def _uses(model: nn.Module, layer_type: type[nn.Module]) -> bool:
    """Whether a layer of exactly ``layer_type`` is in the model (it is watched by its rule)."""
    return any(type(m) is layer_type for m in model.modules())


def test_every_registered_layer_type_has_an_example() -> None:
    missing = [t.__name__ for t in LAYERS if t not in EXAMPLES]
    assert not missing, f"registered layer types without an example here: {missing}"
    assert set(EXAMPLES) == set(LAYERS)  # no stale example either


@pytest.mark.parametrize("layer_type", LAYERS, ids=lambda t: t.__name__)
def test_an_empty_batch_is_a_noise_only_step_that_is_accounted(layer_type) -> None:
    """Fast engine: no crash, one more ledger step, every parameter moves by σ·C/B noise."""
    probe, shape = _probe(layer_type)
    n = 40
    x = _inputs(probe, n, shape, seed=1)
    data = TensorDataset(x, torch.arange(n) % CLASSES)
    optimizer = torch.optim.SGD(probe.parameters(), lr=1.0)  # update = -(noisy mean gradient)
    contains = _uses(probe, layer_type)  # or, for InProjection, its substitute once attached
    private = dpfy.make_private(
        probe, optimizer, data, batch_size=int(BATCH), steps=200, noise_multiplier=SIGMA,
        delta=1e-5, max_grad_norm=CLIP, engine="fast", seed=3,
    )  # fmt: skip
    assert private.optimizer.engine.kind == "fast"
    assert contains or _uses(probe, layer_type), "the example lacks the layer type under test"
    names = [name for name, p in probe.named_parameters() if p.requires_grad]
    sizes, noise = [], []
    for xb, yb in rest_of_run(private.loader):
        before = {name: p.detach().clone() for name, p in probe.named_parameters()}
        steps = private.ledger.steps
        private.optimizer.zero_grad()
        F.cross_entropy(private.model(xb), yb).backward()
        private.optimizer.step()
        assert private.ledger.steps == steps + 1
        sizes.append(xb.shape[0])
        moved = {name: before[name] - p.detach() for name, p in probe.named_parameters()}
        assert all(bool(torch.isfinite(m).all()) for m in moved.values())
        if xb.shape[0] == 0:
            for name in names:  # every trainable parameter gets noise, the layer's own too
                assert torch.count_nonzero(moved[name]) == moved[name].numel(), name
            noise.append(torch.cat([moved[name].flatten() for name in names]))
        if 0 in sizes and max(sizes) > 0 and len(noise) >= 3:
            break
    assert 0 in sizes and max(sizes) > 0, f"seeded run had no empty or no full batch: {sizes}"
    pooled = torch.cat(noise).double() / (SIGMA * CLIP / BATCH)  # N(0, 1) if pure noise
    count = pooled.numel()
    assert count >= 500
    # Five standard errors: the std of a sample std is about 1/sqrt(2·count).
    assert abs(float(pooled.std()) - 1.0) < 5 / math.sqrt(2 * count)
    assert abs(float(pooled.mean())) < 5 / math.sqrt(count)


@pytest.mark.parametrize("kind", ["fast", "vmap"])
@pytest.mark.parametrize("layer_type", LAYERS, ids=lambda t: t.__name__)
def test_engines_take_an_empty_batch_and_add_nothing(layer_type, kind) -> None:
    """Both engines, straight: a zero-row forward and backward, then 0 examples, zero sums."""
    probe, shape = _probe(layer_type)
    names = {name for name, _ in probe.named_parameters()}  # as the user's model names them
    engine = make_engine(probe, kind)
    try:
        out = probe(_inputs(probe, 0, shape))
        assert out.shape == (0, CLASSES)
        F.cross_entropy(out, torch.zeros(0, dtype=torch.long), reduction="sum").backward()
        result = engine.clip_and_accumulate(CLIP, "sum")
        assert result.num_examples == 0 and result.num_units == 0
        sums = engine.summed_grads()
        assert set(sums) == names
        assert all(torch.count_nonzero(s) == 0 for s in sums.values())
        # The next, non-empty batch is clipped as usual.
        F.cross_entropy(probe(_inputs(probe, 3, shape)), torch.tensor([0, 1, 2])).backward()
        assert engine.clip_and_accumulate(CLIP).num_examples == 3
    finally:
        engine.detach()


@pytest.mark.parametrize("layer_type", LAYERS, ids=lambda t: t.__name__)
def test_fast_sums_match_vmap_on_a_full_batch(layer_type) -> None:
    """The rule of every registered type (InstanceNorm's too) clips exactly as vmap does."""
    probe, shape = _probe(layer_type)
    x, y = _inputs(probe, 5, shape, seed=2), torch.tensor([0, 1, 2, 3, 4])
    sums = {}
    for kind in ("fast", "vmap"):
        engine = make_engine(probe, kind)
        F.cross_entropy(probe(x), y, reduction="sum").backward()
        norms = engine.clip_and_accumulate(0.05, "sum").norms  # small C: every example clipped
        sums[kind] = {name: s.clone() for name, s in engine.summed_grads().items()}
        engine.detach()
        assert bool((norms > 0.05).all())
    for name, value in sums["vmap"].items():
        torch.testing.assert_close(sums["fast"][name], value, rtol=1e-4, atol=1e-6)


def _empty_call(layer: nn.Module, shape: tuple[int, ...], indices: bool) -> Call:
    """The call a rule would see for a zero-row batch: empty inputs, zero output gradients.

    The outputs' shapes come from a one-row batch (torch's own InstanceNorm raises on none).
    """
    x = torch.zeros((1, *shape), dtype=torch.long if indices else torch.float32)
    one = (x, x, x) if isinstance(layer, InProjection) else (x,)
    with torch.no_grad():
        outputs = [o[:0] for o in output_tensors(layer(*one))]
    inputs = tuple(i[:0] for i in one)
    if isinstance(layer, InProjection):
        inputs = (inputs[0],) * 3  # self-attention: one input tensor for q, k and v
    return Call(
        inputs=inputs,
        grads=[torch.zeros_like(o) for o in outputs],
        out_meta=[(o.shape, o.dtype, o.device) for o in outputs],
        out_index=list(range(len(outputs))),
        versions=tuple(None for _ in inputs),
        trainable=frozenset(n for n, p in layer.named_parameters(recurse=False) if p.requires_grad),
    )


@pytest.mark.parametrize("layer_type", LAYERS, ids=lambda t: t.__name__)
def test_each_rule_function_takes_zero_rows(layer_type) -> None:
    """sq_norms, clipped_sum and per_example_grads called on B = 0 give empty or zero results."""
    probe, shape = _probe(layer_type)
    layer = probe.layer
    if isinstance(layer, Attention):
        layer, shape = InProjection(layer.attention), (4, 6)
    if isinstance(layer, Recurrent):
        layer = layer.rnn
    rule = find_rule(layer)
    assert rule is not None and type(layer) is layer_type
    if rule.from_rows:  # whole per-example gradients from the call as captured (recurrent)
        x = torch.zeros((0, *shape))
        with torch.no_grad():
            outputs = list(output_tensors(layer(x)))
        call = Call(
            inputs=(x,),
            grads=[torch.zeros_like(o) for o in outputs],
            out_meta=[(o.shape, o.dtype, o.device) for o in outputs],
            out_index=list(range(len(outputs))),
            versions=(None,),
            trainable=frozenset(n for n, _ in layer.named_parameters(recurse=False)),
        )
        rows = rule.example_rows(layer, call)
        assert rows is not None and set(rows) == set(call.trainable)
        for name, value in rows.items():
            assert value.shape == (0, *getattr(layer, name).shape)
        return
    call = _empty_call(layer, shape, probe.indices)
    assert rule.sq_norms(layer, call).shape == (0,)
    sums = rule.clipped_sum(layer, call, torch.zeros(0))  # same call: sq_norms may fill its cache
    params = dict(layer.named_parameters(recurse=False))
    assert set(sums) == set(call.trainable)
    for name, value in sums.items():
        assert value.shape == params[name].shape and torch.count_nonzero(value) == 0
    grads = rule.per_example_grads(layer, _empty_call(layer, shape, probe.indices))
    for name, rows in (grads or {}).items():
        joined = rows if isinstance(rows, Tensor) else rows.joined()
        assert joined.shape == (0, params[name].numel())


@pytest.mark.parametrize("norm", [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d])
def test_instance_norm_is_swapped_while_attached_and_put_back(norm) -> None:
    """torch's instance_norm raises on an empty batch; the attached layer takes one, exactly."""
    torch.manual_seed(0)
    shape = {nn.InstanceNorm1d: (6, 8), nn.InstanceNorm2d: (6, 4, 4)}.get(norm, (6, 2, 3, 3))
    plain = nn.Sequential(norm(6), norm(6, affine=True))  # the first has no parameters
    x = torch.randn(3, *shape)
    expected = plain(x)
    keys = list(plain.state_dict())
    for kind in ("fast", "vmap"):
        head = nn.Linear(math.prod(shape), 2)
        engine = make_engine(nn.Sequential(plain, nn.Flatten(), head), kind)
        assert all(isinstance(m, norm) for m in plain)  # still an instance of the user's class
        assert plain(torch.randn(0, *shape)).shape == (0, *shape)
        torch.testing.assert_close(plain(x), expected, rtol=0, atol=0)
        assert list(plain.state_dict()) == keys
        engine.detach()
        assert all(type(m) is norm for m in plain)
    with pytest.raises((IndexError, RuntimeError)):
        plain(torch.randn(0, *shape))  # torch's own layer, back in place


def test_cli_cnn_trains_through_empty_batches(tmp_path) -> None:
    """`dpfy train --model cnn --batch-size 2 --epochs 0.1`: hundreds of steps, many empty."""
    out = tmp_path / "run"
    args = ["train", "--model", "cnn", "--batch-size", "2", "--epochs", "0.1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert out.is_dir() and any(out.iterdir())
