"""Reference models build for their inputs, hold no BatchNorm and run on the fast engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpfy.train.grads import make_engine
from dpfy.train.models import available_models, build_model, register_model

CASES = [
    ("logreg", (64,)),
    ("logreg", (1, 28, 28)),
    ("logreg", (30,)),
    ("mlp", (64,)),
    ("mlp", (1, 8, 8)),
    ("mlp", (1, 28, 28)),
    ("mlp", (105,)),
    ("cnn", (1, 8, 8)),
    ("cnn", (1, 28, 28)),
    ("cnn", (3, 32, 32)),
]


def test_available_models():
    models = available_models()
    assert set(models) == {"logreg", "mlp", "cnn"}
    assert all(models.values())


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_forward_gives_one_logit_per_class(name, shape):
    model = build_model(name, shape, num_classes=7)
    out = model(torch.randn(3, *shape))
    assert out.shape == (3, 7) and torch.isfinite(out).all()


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_no_batch_coupled_layers(name, shape):
    model = build_model(name, shape, 10)
    coupled = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    assert not [m for m in model.modules() if isinstance(m, coupled)]


@pytest.mark.parametrize(("name", "shape"), CASES)
def test_fast_engine_runs_and_agrees_with_vmap(name, shape):
    """Per-example norms from the fast engine equal the torch.func reference."""
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    x, y = torch.randn(6, *shape), torch.randint(0, 10, (6,))
    norms = {}
    for kind in ("fast", "vmap"):
        engine = make_engine(model, kind)
        assert engine.kind == kind
        nn.functional.cross_entropy(model(x), y).backward()
        norms[kind] = engine.clip_and_accumulate(max_grad_norm=1.0).norms
        engine.detach()
    assert norms["fast"].shape == (6,) and (norms["fast"] > 0).all()
    torch.testing.assert_close(norms["fast"], norms["vmap"], rtol=1e-4, atol=1e-6)


def test_cnn_for_28x28_is_the_documented_architecture():
    model = build_model("cnn", (1, 28, 28), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride, c.padding) for c in convs] == [
        (16, (8, 8), (2, 2), (2, 2)),
        (32, (4, 4), (2, 2), (0, 0)),
    ]
    assert model.fc.in_features == 512 and model.fc.out_features == 32
    assert sum(isinstance(m, nn.GroupNorm) for m in model.modules()) == 2
    assert sum(isinstance(m, nn.Tanh) for m in model.modules()) == 3
    assert sum(p.numel() for p in model.parameters()) == 26_106


def test_cnn_for_small_images_uses_the_compact_stem():
    model = build_model("cnn", (1, 8, 8), 10)
    first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first.kernel_size == (3, 3)
    assert model.fc.in_features == 32 * 2 * 2


def test_cnn_options():
    plain = build_model("cnn", (1, 28, 28), 10, norm_groups=None, activation="relu")
    assert not any(isinstance(m, nn.GroupNorm) for m in plain.modules())
    assert any(isinstance(m, nn.ReLU) for m in plain.modules())
    with pytest.raises(ValueError, match="must divide"):
        build_model("cnn", (1, 28, 28), 10, norm_groups=5)


def test_cnn_refuses_flat_or_tiny_inputs():
    with pytest.raises(ValueError, match=r"\(channels, height, width\)"):
        build_model("cnn", (64,), 10)
    with pytest.raises(ValueError, match="too small"):
        build_model("cnn", (1, 2, 2), 10)


def test_mlp_hidden_sizes_and_activation():
    model = build_model("mlp", (64,), 10, hidden_sizes=(32, 16), activation="relu")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16), (16, 10)]
    assert sum(isinstance(m, nn.ReLU) for m in model.modules()) == 2
    default = build_model("mlp", (64,), 10)
    assert sum(isinstance(m, nn.Tanh) for m in default.modules()) == 1
    with pytest.raises(ValueError, match="activation"):
        build_model("mlp", (64,), 10, activation="gelu")
    with pytest.raises(ValueError, match="hidden_sizes"):
        build_model("mlp", (64,), 10, hidden_sizes=(0,))


def test_logreg_is_one_linear_layer():
    model = build_model("logreg", (1, 8, 8), 10)
    params = dict(model.named_parameters())
    assert {k: tuple(v.shape) for k, v in params.items()} == {
        "linear.weight": (10, 64),
        "linear.bias": (10,),
    }


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("resnet", (1, 8, 8), 10), {}, r"unknown model 'resnet'.*cnn, logreg, mlp"),
        (("mlp", (64,), 10), {"depth": 3}, r"takes no option\(s\) \['depth'\]"),
        (("logreg", (), 10), {}, "input_shape"),
        (("logreg", (0, 3), 10), {}, "input_shape"),
        (("logreg", (4,), 1), {}, "num_classes"),
        (("logreg", (4,), 2.5), {}, "num_classes"),
    ],
)
def test_bad_requests_are_refused(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model(*args, **kwargs)


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):
        register_model("mlp", "again")(lambda shape, classes: nn.Identity())
