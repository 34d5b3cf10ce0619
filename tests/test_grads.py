"""Per-example gradient engines against a batch-of-one reference (loop, backward, clip, sum)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from dpfy.train.grads import layout, make_engine
from dpfy.train.grads.rows import Rows
from dpfy.train.grads.rules._bilinear import direct_sq_norms, ghost_sq_norms, use_ghost
from dpfy.train.grads.substitutions import DPMultiheadAttention


@pytest.fixture(autouse=True, scope="module")
def _float64_by_default():
    """Compare in float64 here, without changing the default for other test modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


LossFn = Callable[[Tensor, Tensor], Tensor]
FEW = settings(max_examples=12, deadline=None)


def squared_error(out: Tensor, target: Tensor) -> Tensor:
    """Per-example loss: squared error summed over all non-batch dims."""
    return (out - target).square().flatten(1).sum(1)


def reference(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    clip: float,
    microbatch: int | None = None,
    forward: Callable[[nn.Module, Tensor], Tensor] | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Clipped sum and unit norms from single-example backward passes (guide alg. 1 and 3)."""
    forward = forward or (lambda m, inp: m(inp))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    per_example = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        loss_fn(forward(model, x[i : i + 1]), y[i : i + 1]).sum().backward()
        per_example.append(
            {
                n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in params.items()
            }
        )
    model.zero_grad(set_to_none=True)
    k = microbatch or 1
    units = [per_example[i : i + k] for i in range(0, len(per_example), k)]
    averaged = [{n: sum(g[n] for g in unit) / len(unit) for n in params} for unit in units]
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in u.values())) for u in averaged])
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for u, norm in zip(averaged, norms, strict=True):
        factor = min(1.0, clip / float(norm)) if float(norm) > 0 else 1.0
        for n in params:
            total[n] += factor * u[n]
    return total, norms


def run_engine(
    model: nn.Module,
    kind: str,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    clip: float,
    reduction: str,
    microbatch: int | None = None,
    forward: Callable[[nn.Module, Tensor], Tensor] | None = None,
    **make_kwargs: object,
) -> tuple[dict[str, Tensor], Tensor, object]:
    """One forward/backward with the engine attached; returns sums, norms, and the engine.

    The sums open from a known offset, as a private step opens them from their noise: rules
    that add in place (``add_clipped_sum``) are checked on that path; the offset is then removed.
    """
    forward = forward or (lambda m, inp: m(inp))
    engine = make_engine(model, kind, **make_kwargs)
    try:
        losses = loss_fn(forward(model, x), y)
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
        offset = Offset(frozenset(engine.params))
        result = engine.clip_and_accumulate(
            clip, reduction, microbatch_size=microbatch, noise=offset
        )
        assert all(p.grad is None for p in model.parameters() if p.requires_grad)
        assert offset.given == set(engine.params)  # every parameter got its "noise" once
        sums = {name: value - 0.5 for name, value in engine.summed_grads().items()}
        return sums, result.norms, engine
    finally:
        engine.detach()


@dataclasses.dataclass
class Offset:
    """A stand-in for the noise: every sum opens from 0.5 (or gets 0.5 added), once each."""

    names: frozenset[str]
    given: set[str] = dataclasses.field(default_factory=set)

    def fill(self, name: str, out: Tensor) -> None:
        assert name not in self.given
        self.given.add(name)
        out.fill_(0.5)

    def add(self, name: str, total: Tensor) -> None:
        assert name not in self.given
        self.given.add(name)
        total.add_(0.5)


def assert_matches_reference(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    kinds: tuple[str, ...] = ("fast", "vmap"),
    loss_fn: LossFn = squared_error,
    clip_ratio: float = 0.5,
    reduction: str = "mean",
    microbatch: int | None = None,
    forward: Callable[[nn.Module, Tensor], Tensor] | None = None,
    **make_kwargs: object,
) -> None:
    """Both engines give the reference's clipped sum and unit norms to float64 tolerance."""
    _, free_norms = reference(model, loss_fn, x, y, math.inf, microbatch, forward)
    clip = clip_ratio * float(free_norms.median()) + 1e-12
    expected, ref_norms = reference(model, loss_fn, x, y, clip, microbatch, forward)
    for kind in kinds:
        sums, norms, _ = run_engine(
            model, kind, loss_fn, x, y, clip, reduction, microbatch, forward, **make_kwargs
        )
        torch.testing.assert_close(norms, ref_norms, rtol=1e-7, atol=1e-9, msg=f"{kind} norms")
        assert sums.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(
                sums[name], expected[name], rtol=1e-7, atol=1e-9, msg=f"{kind}: {name}"
            )


reductions = st.sampled_from(["mean", "sum"])
clip_ratios = st.sampled_from([0.05, 0.7, 100.0])  # binds all, some, none
microbatches = st.sampled_from([None, None, 1, 2, 3])


# ----------------------------------------------------------------------------- Linear


@FEW
@given(
    batch=st.integers(1, 5),
    positions=st.sampled_from([(), (1,), (3,), (2, 3)]),
    d_in=st.integers(1, 6),
    d_out=st.integers(1, 6),
    bias=st.booleans(),
    reduction=reductions,
    clip_ratio=clip_ratios,
    microbatch=microbatches,
)
def test_linear_matches_reference(
    batch, positions, d_in, d_out, bias, reduction, clip_ratio, microbatch
) -> None:
    torch.manual_seed(batch * 31 + d_in)
    model = nn.Sequential(nn.Linear(d_in, 5, bias=bias), nn.Tanh(), nn.Linear(5, d_out))
    x = torch.randn(batch, *positions, d_in)
    y = torch.randn(batch, *positions, d_out)
    assert_matches_reference(
        model, x, y, reduction=reduction, clip_ratio=clip_ratio, microbatch=microbatch
    )


@FEW
@given(
    units=st.integers(1, 4),
    positions=st.integers(1, 7),
    d_in=st.integers(1, 9),
    d_out=st.integers(1, 9),
)
def test_ghost_and_direct_norms_agree(units, positions, d_in, d_out) -> None:
    a = torch.randn(units, positions, d_in)
    g = torch.randn(units, positions, d_out)
    direct = direct_sq_norms(a, g)
    ghost = ghost_sq_norms(a, g)
    explicit = torch.stack([(g[u].T @ a[u]).square().sum() for u in range(units)])
    torch.testing.assert_close(ghost, direct)
    torch.testing.assert_close(direct, explicit)


def test_cost_formula_picks_the_cheaper_path() -> None:
    assert use_ghost(4, 64, 64)  # 2·16 < 4096
    assert not use_ghost(64, 16, 16)  # 2·4096 > 256


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("microbatch", [None, 2])
def test_linear_sequence_ghost_and_direct_routes_match_reference(
    monkeypatch, ghost, microbatch
) -> None:
    import dpfy.train.grads.rules._bilinear as bilinear

    monkeypatch.setattr(bilinear, "use_ghost", lambda *shape: ghost)
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(5, 7, 4), torch.randn(5, 7, 3)
    assert_matches_reference(model, x, y, microbatch=microbatch)


# ----------------------------------------------------------------------------- Conv


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("microbatch", [None, 2])
def test_conv_ghost_and_direct_routes_match_reference(monkeypatch, ghost, microbatch) -> None:
    import dpfy.train.grads.rules.conv as conv

    monkeypatch.setattr(conv, "use_ghost", lambda *shape: ghost)
    torch.manual_seed(15)
    model = nn.Sequential(
        nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 9, 2),
    )
    x, y = torch.randn(5, 4, 5, 6), torch.randn(5, 2)
    assert_matches_reference(model, x, y, microbatch=microbatch, reduction="sum")
    model1d = nn.Sequential(
        nn.Conv1d(2, 4, 3, dilation=2, padding="same", padding_mode="circular"),
        nn.Flatten(),
        nn.Linear(4 * 8, 2),
    )
    x1, y1 = torch.randn(5, 2, 8), torch.randn(5, 2)
    assert_matches_reference(model1d, x1, y1, microbatch=microbatch)


POSITION_GRAM_CASES = {
    "3x3 padded": (lambda: nn.Conv2d(4, 6, 3, padding=1), (5, 4, 6, 7)),
    "strided, dilated, grouped": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2),
        (5, 4, 9, 8),
    ),
    "2x3 same, reflect, no bias": (
        lambda: nn.Conv2d(3, 4, (2, 3), padding="same", padding_mode="reflect", bias=False),
        (5, 3, 6, 6),
    ),
    "1x1": (lambda: nn.Conv2d(2, 4, 1), (5, 2, 3, 3)),
    "1-d strided circular": (
        lambda: nn.Conv1d(2, 4, 3, stride=2, dilation=2, padding=2, padding_mode="circular"),
        (5, 2, 11),
    ),
}


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("position_gram", [True, False])
@pytest.mark.parametrize("case", sorted(POSITION_GRAM_CASES))
def test_conv_ghost_norms_from_the_input_positions_gram_match_reference(
    monkeypatch, case, position_gram
) -> None:
    """The patches' Gram summed from the input positions' Gram is exact, wherever it is used."""
    import dpfy.train.grads.rules.conv as conv

    monkeypatch.setattr(conv, "use_ghost", lambda *shape: True)
    monkeypatch.setattr(conv, "use_position_gram", lambda *shape: position_gram)
    calls, patch_gram = [], conv.patch_gram
    monkeypatch.setattr(conv, "patch_gram", lambda *a: calls.append(1) or patch_gram(*a))
    make_conv, shape = POSITION_GRAM_CASES[case]
    torch.manual_seed(16)
    model = nn.Sequential(make_conv(), nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(*shape)
    model(x)  # materialise the lazy layer
    assert_matches_reference(model, x, torch.randn(shape[0], 2), kinds=("fast",))
    assert bool(calls) == position_gram


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@FEW
@given(
    dims=st.sampled_from([1, 2]),
    batch=st.integers(1, 4),
    groups=st.sampled_from([1, 2]),
    per_group_in=st.integers(1, 2),
    per_group_out=st.integers(1, 2),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.sampled_from([0, 1, "same", "valid"]),
    padding_mode=st.sampled_from(["zeros", "reflect", "circular", "replicate"]),
    bias=st.booleans(),
    reduction=reductions,
    clip_ratio=clip_ratios,
    microbatch=microbatches,
)
def test_conv_matches_reference(
    dims,
    batch,
    groups,
    per_group_in,
    per_group_out,
    kernel,
    stride,
    dilation,
    padding,
    padding_mode,
    bias,
    reduction,
    clip_ratio,
    microbatch,
) -> None:
    if padding == "same":
        stride = 1  # torch refuses padding='same' with stride > 1
    conv_cls = nn.Conv1d if dims == 1 else nn.Conv2d
    torch.manual_seed(batch + 7 * kernel)
    conv = conv_cls(
        groups * per_group_in,
        groups * per_group_out,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=bias,
        padding_mode=padding_mode,
    )
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(batch, groups * per_group_in, *([6] * dims))
    model(x)  # materialise the lazy layer
    y = torch.randn(batch, 2)
    assert_matches_reference(
        model, x, y, reduction=reduction, clip_ratio=clip_ratio, microbatch=microbatch
    )


@pytest.mark.parametrize("microbatch", [None, 2])
def test_per_example_reductions_in_batch_slices_match_reference(monkeypatch, microbatch) -> None:
    """Large inputs are reduced slice by slice of the batch (memory); small ones in one piece."""
    monkeypatch.setattr(layout, "SLICE_ABOVE_BYTES", 0)  # slice even these small inputs
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
        nn.Linear(4 * 5 * 5, 2),
    )  # fmt: skip
    x = torch.randn(6, 2, 5, 5)
    assert len(layout.batch_slices(x)) > 1
    assert_matches_reference(model, x, torch.randn(6, 2), microbatch=microbatch)


def test_batch_slices_cover_the_batch_in_order() -> None:
    small = torch.zeros(10, 3)
    large = torch.empty(10, layout.SLICE_ABOVE_BYTES, dtype=torch.uint8)  # untouched: no pages
    assert layout.batch_slices(small) == [slice(0, 10)]
    slices = layout.batch_slices(large)
    assert len(slices) == layout.BATCH_SLICES
    assert [i for s in slices for i in range(10)[s]] == list(range(10))


# ----------------------------------------------------------------------------- Embedding


@FEW
@given(
    batch=st.integers(1, 4),
    positions=st.integers(1, 6),
    vocab=st.integers(2, 5),  # a small vocabulary forces repeated indices
    padding_idx=st.sampled_from([None, 0, 1]),
    reduction=reductions,
    clip_ratio=clip_ratios,
    microbatch=microbatches,
)
def test_embedding_matches_reference(
    batch, positions, vocab, padding_idx, reduction, clip_ratio, microbatch
) -> None:
    torch.manual_seed(batch * 3 + positions)
    model = nn.Sequential(nn.Embedding(vocab, 3, padding_idx=padding_idx), nn.Linear(3, 2))
    x = torch.randint(0, vocab, (batch, positions))
    x[0, 0] = x[0, -1]  # at least one repeat
    y = torch.randn(batch, positions, 2)
    assert_matches_reference(
        model, x, y, reduction=reduction, clip_ratio=clip_ratio, microbatch=microbatch
    )


def test_embedding_padding_row_gets_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4, 3, padding_idx=2), nn.Linear(3, 1))
    x = torch.tensor([[2, 2, 1], [2, 0, 2]])
    sums, _, _ = run_engine(model, "fast", squared_error, x, torch.randn(2, 3, 1), 1.0, "sum")
    assert torch.count_nonzero(sums["0.weight"][2]) == 0
    assert torch.count_nonzero(sums["0.weight"][1]) > 0


# ----------------------------------------------------------------------------- norm layers


@FEW
@given(
    kind=st.sampled_from(["layer", "rms", "group"]),
    batch=st.integers(1, 4),
    affine_bias=st.booleans(),
    reduction=reductions,
    clip_ratio=clip_ratios,
    microbatch=microbatches,
)
def test_norm_layers_match_reference(
    kind, batch, affine_bias, reduction, clip_ratio, microbatch
) -> None:
    torch.manual_seed(batch)
    if kind == "group":
        norm = nn.GroupNorm(2, 4, affine=True)
        x = torch.randn(batch, 4, 3, 2)
        model = nn.Sequential(nn.Conv2d(4, 4, 1), norm, nn.Flatten(), nn.Linear(24, 2))
        y = torch.randn(batch, 2)
    else:
        norm = nn.LayerNorm(5, bias=affine_bias) if kind == "layer" else nn.RMSNorm(5)
        x = torch.randn(batch, 3, 5)
        model = nn.Sequential(nn.Linear(5, 5), norm, nn.Linear(5, 2))
        y = torch.randn(batch, 3, 2)
    with torch.no_grad():  # non-trivial affine parameters
        for p in norm.parameters():
            p.add_(torch.randn_like(p))
    assert_matches_reference(
        model, x, y, reduction=reduction, clip_ratio=clip_ratio, microbatch=microbatch
    )


def test_layer_norm_over_two_dims() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.LayerNorm((3, 4)), nn.Flatten(), nn.Linear(12, 2))
    with torch.no_grad():
        model[0].weight.add_(torch.randn(3, 4))
    assert_matches_reference(model, torch.randn(5, 3, 4), torch.randn(5, 2))


# ----------------------------------------------------------------------------- attention


class TinyTransformer(nn.Module):
    """Embedding → TransformerEncoder → mean pool → Linear, with a key padding mask."""

    def __init__(self, batch_first: bool = True, vocab: int = 11, norm_first: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab, 8, padding_idx=0)
        layer = nn.TransformerEncoderLayer(
            8,
            2,
            dim_feedforward=12,
            dropout=0.0,
            batch_first=batch_first,
            norm_first=norm_first,
            activation="gelu" if norm_first else "relu",
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        pad = tokens == 0
        if self.batch_first:
            h = self.encoder(self.embed(tokens), src_key_padding_mask=pad)
            return self.head(h.mean(1))
        h = self.encoder(self.embed(tokens.T), src_key_padding_mask=pad)  # (T, B, d) throughout
        return self.head(h.mean(0))  # pooled (B, d): batch first again


def cross_entropy(out: Tensor, target: Tensor) -> Tensor:
    """Per-example cross-entropy."""
    return nn.functional.cross_entropy(out, target, reduction="none")


@pytest.mark.parametrize(
    ("batch_first", "microbatch", "norm_first"),
    [(True, None, False), (False, None, False), (True, 2, False), (False, 2, True)],
)
def test_transformer_encoder_fast_matches_reference(batch_first, microbatch, norm_first) -> None:
    torch.manual_seed(2)
    model = TinyTransformer(batch_first, norm_first=norm_first)
    tokens = torch.randint(1, 11, (5, 6))
    tokens[1, 4:] = 0  # padded example
    y = torch.randint(0, 3, (5,))
    engine = make_engine(model, batch_first=batch_first)
    assert engine.kind == "fast", engine.fallback_reason
    engine.detach()
    assert_matches_reference(
        model,
        tokens,
        y,
        loss_fn=cross_entropy,
        microbatch=microbatch,
        batch_first=batch_first,
    )


mha_options = st.fixed_dictionaries(
    {
        "batch_first": st.booleans(),
        "bias": st.booleans(),
        "add_zero_attn": st.booleans(),
        "cross": st.sampled_from(["self", "same_dim", "kdim_vdim"]),
        "need_weights": st.booleans(),
        "average_attn_weights": st.booleans(),
        "attn_mask": st.sampled_from([None, "bool2d", "float2d", "float3d", "causal"]),
        "key_padding_mask": st.sampled_from([None, "bool", "float"]),
        "unbatched": st.booleans(),
    }
)


def _attention_inputs(opts: dict, embed: int, heads: int) -> tuple[nn.Module, tuple, dict]:
    """An nn.MultiheadAttention and call arguments for the given options."""
    kdim = vdim = None
    if opts["cross"] == "kdim_vdim":
        kdim, vdim = 3, 5
    mha = nn.MultiheadAttention(
        embed,
        heads,
        bias=opts["bias"],
        add_zero_attn=opts["add_zero_attn"],
        kdim=kdim,
        vdim=vdim,
        batch_first=opts["batch_first"],
    )
    batch, tgt, src = 3, 4, 5
    if opts["cross"] == "self":
        src = tgt
    shape = (
        (lambda length, dim: (batch, length, dim))
        if opts["batch_first"]
        else (lambda length, dim: (length, batch, dim))
    )
    query = torch.randn(shape(tgt, embed))
    key = query if opts["cross"] == "self" else torch.randn(shape(src, kdim or embed))
    value = query if opts["cross"] == "self" else torch.randn(shape(src, vdim or embed))
    kwargs: dict = {
        "need_weights": opts["need_weights"],
        "average_attn_weights": opts["average_attn_weights"],
    }
    if opts["attn_mask"] in ("bool2d", "causal"):
        kwargs["attn_mask"] = torch.triu(torch.ones(tgt, src, dtype=torch.bool), 1)
        kwargs["is_causal"] = opts["attn_mask"] == "causal" and tgt == src
    elif opts["attn_mask"] == "float2d":
        kwargs["attn_mask"] = torch.randn(tgt, src)
    elif opts["attn_mask"] == "float3d":
        kwargs["attn_mask"] = torch.randn(batch * heads, tgt, src)
    if opts["key_padding_mask"] == "bool":
        mask = torch.zeros(batch, src, dtype=torch.bool)
        mask[0, -2:] = True
        kwargs["key_padding_mask"] = mask
    elif opts["key_padding_mask"] == "float":
        kwargs["key_padding_mask"] = torch.randn(batch, src)
    if opts["unbatched"]:
        batch_dim = 0 if opts["batch_first"] else 1
        query = query.select(batch_dim, 0)
        key = query if opts["cross"] == "self" else key.select(batch_dim, 0)
        value = query if opts["cross"] == "self" else value.select(batch_dim, 0)
        if opts["attn_mask"] == "float3d":  # a per-batch mask has no unbatched form
            kwargs.pop("attn_mask")
        if kwargs.get("is_causal") and "attn_mask" not in kwargs:
            kwargs["is_causal"] = False
        if "key_padding_mask" in kwargs:
            kwargs["key_padding_mask"] = kwargs["key_padding_mask"][0]
    return mha, (query, key, value), kwargs


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@settings(max_examples=40, deadline=None)
@given(opts=mha_options)
def test_mha_substitution_gives_identical_outputs(opts) -> None:
    torch.manual_seed(3)
    mha, args, kwargs = _attention_inputs(opts, embed=6, heads=2)
    if kwargs.get("is_causal") and "attn_mask" not in kwargs:
        kwargs["is_causal"] = False
    substitute = DPMultiheadAttention(mha)
    expected_out, expected_weights = mha(*args, **kwargs)
    out, weights = substitute(*args, **kwargs)
    torch.testing.assert_close(out, expected_out, equal_nan=True)
    if expected_weights is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, expected_weights, equal_nan=True)
    params = {id(p) for p in mha.parameters()}
    assert {id(p) for p in substitute.parameters()} == params  # the same Parameter objects


class CrossAttention(nn.Module):
    """Cross-attention with distinct key/value dims, then a head (exercises unpacked weights)."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        kv = None if packed else 3
        self.attention = nn.MultiheadAttention(4, 2, kdim=kv, vdim=kv, batch_first=True)
        self.memory = nn.Linear(2, 4 if packed else 3)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        query, memory = x[..., :4], self.memory(x[..., 4:])
        out, _ = self.attention(query, memory, memory, need_weights=False)
        return self.head(out)


@pytest.mark.parametrize("packed", [True, False])
def test_cross_attention_matches_reference(packed) -> None:
    torch.manual_seed(4)
    model = CrossAttention(packed)
    x, y = torch.randn(4, 5, 6), torch.randn(4, 5, 1)
    assert_matches_reference(model, x, y, microbatch=None)
    assert_matches_reference(model, x, y, reduction="sum", microbatch=3)


# ----------------------------------------------------------------------------- engine choice


class Scale(nn.Module):
    """A layer with no fast rule: elementwise learned scaling."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(size))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


def _unsupported_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh(), nn.Linear(4, 2))


def test_auto_falls_back_to_vmap_and_names_the_layer() -> None:
    torch.manual_seed(5)
    model = _unsupported_model()
    engine = make_engine(model)
    assert engine.kind == "vmap"
    assert "'1'" in engine.fallback_reason and "Scale" in engine.fallback_reason
    engine.detach()
    assert make_engine(nn.Linear(2, 2)).fallback_reason is None
    assert_matches_reference(model, torch.randn(6, 3), torch.randn(6, 2), kinds=("auto",))


def test_fast_on_unsupported_layer_raises() -> None:
    with pytest.raises(ValueError, match=r"'1' \(Scale\).*engine='vmap'"):
        make_engine(_unsupported_model(), "fast")


def test_subclass_with_own_forward_gets_no_rule() -> None:
    class Doubled(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    assert make_engine(nn.Sequential(Doubled(2, 2)), "auto").kind == "vmap"


def test_add_bias_kv_attention_is_refused() -> None:
    model = nn.Sequential()
    model.add_module("att", nn.MultiheadAttention(4, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_bias_kv"):
        make_engine(model, "vmap")


def test_batch_first_mismatch_is_refused() -> None:
    model = nn.Sequential()
    model.add_module("att", nn.MultiheadAttention(4, 2, batch_first=False))
    with pytest.raises(ValueError, match="batch_first"):
        make_engine(model)


def test_bad_arguments_are_refused() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="engine"):
        make_engine(model, "fastest")
    engine = make_engine(model)
    model(torch.randn(3, 2)).sum().backward()
    with pytest.raises(ValueError, match="max_grad_norm"):
        engine.clip_and_accumulate(0.0)
    with pytest.raises(ValueError, match="loss_reduction"):
        engine.clip_and_accumulate(1.0, "avg")
    with pytest.raises(ValueError, match="microbatch_size"):
        engine.clip_and_accumulate(1.0, microbatch_size=0)


# ----------------------------------------------------------------------------- repeated use


class Twice(nn.Module):
    """One Linear applied twice in a forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(torch.tanh(self.layer(x)))


def test_repeated_call_is_refused_by_fast_and_handled_by_vmap() -> None:
    torch.manual_seed(6)
    model = Twice()
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    engine = make_engine(model, "fast")
    squared_error(model(x), y).sum().backward()
    with pytest.raises(ValueError, match="called 2 times"):
        engine.clip_and_accumulate(1.0)
    engine.detach()
    assert_matches_reference(model, x, y, kinds=("vmap",))
    assert_matches_reference(model, x, y, kinds=("vmap",), microbatch=3)


def test_tied_weights_run_on_the_fast_engine_and_match_reference() -> None:
    torch.manual_seed(7)
    embed, out = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    out.weight = embed.weight
    model = nn.Sequential(embed, nn.Tanh(), out)
    engine = make_engine(model)
    assert engine.kind == "fast" and engine.fallback_reason is None
    engine.detach()
    x, y = torch.randint(0, 5, (5, 3)), torch.randn(5, 3, 5)
    assert_matches_reference(model, x, y)
    assert_matches_reference(model, x, y, microbatch=2, reduction="sum")


# ----------------------------------------------------------------------------- lifecycle


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_detach_restores_the_model() -> None:
    torch.manual_seed(8)
    model = TinyTransformer()
    tokens = torch.randint(1, 11, (3, 5))
    before = model(tokens).detach()
    keys = list(model.state_dict())
    attention = model.encoder.layers[0].self_attn
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    for kind in ("fast", "vmap"):
        engine = make_engine(model, kind)
        assert isinstance(model.encoder.layers[0].self_attn, DPMultiheadAttention)
        attached = model.state_dict()
        assert list(attached) == keys  # checkpoints taken while attached load anywhere
        model.load_state_dict(attached)
        model(tokens).sum().backward()
        engine.clip_and_accumulate(1.0)
        engine.detach()
        assert model.encoder.layers[0].self_attn is attention
        assert [
            (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()
        ] == hooks
        assert list(model.state_dict()) == keys
        assert all(p.requires_grad for p in model.parameters())
        torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="detached"):
        engine.clip_and_accumulate(1.0)


def test_empty_batch_adds_nothing() -> None:
    model = _mlp()
    for kind in ("fast", "vmap"):
        engine = make_engine(model, kind)
        result = engine.clip_and_accumulate(1.0)  # nothing captured at all
        assert result.num_examples == 0 and result.norms.numel() == 0
        model(torch.randn(0, 3)).sum().backward()
        result = engine.clip_and_accumulate(1.0, "sum")
        assert result.num_examples == 0 and result.num_units == 0
        assert engine.num_examples == 0
        assert all(torch.count_nonzero(g) == 0 for g in engine.summed_grads().values())
        assert set(engine.summed_grads()) == {n for n, _ in model.named_parameters()}
        engine.detach()


def test_virtual_batches_accumulate_and_reset_clears() -> None:
    torch.manual_seed(9)
    model = _mlp()
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    expected, _ = reference(model, squared_error, x, y, 0.3)
    for kind in ("fast", "vmap"):
        engine = make_engine(model, kind)
        for part in (slice(0, 4), slice(4, 7)):
            squared_error(model(x[part]), y[part]).mean().backward()
            engine.clip_and_accumulate(0.3, "mean")
        assert engine.num_examples == 7
        for name, value in engine.summed_grads().items():
            torch.testing.assert_close(value, expected[name])
        engine.write_grads()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name])
        model.zero_grad(set_to_none=True)
        engine.reset()
        assert engine.num_examples == 0
        assert all(torch.count_nonzero(g) == 0 for g in engine.summed_grads().values())
        engine.detach()


def test_frozen_parameters_are_ignored() -> None:
    torch.manual_seed(10)
    model = _mlp()
    model[0].weight.requires_grad_(False)
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    assert_matches_reference(model, x, y)
    sums, _, _ = run_engine(model, "fast", squared_error, x, y, 1.0, "mean")
    assert "0.weight" not in sums and "0.bias" in sums
    assert not model[0].weight.requires_grad


class Branches(nn.Module):
    """Two heads, only one used: the other's parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def test_parameters_without_gradient_contribute_zero() -> None:
    torch.manual_seed(11)
    model = Branches()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    assert_matches_reference(model, x, y)
    sums, _, _ = run_engine(model, "fast", squared_error, x, y, 1.0, "mean")
    assert torch.count_nonzero(sums["unused.weight"]) == 0


def test_forward_without_backward_is_not_a_repeated_call() -> None:
    torch.manual_seed(12)
    model = _mlp()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    expected, _ = reference(model, squared_error, x, y, 0.5)
    engine = make_engine(model, "fast")
    model(torch.randn(2, 3))  # e.g. an evaluation forward with grad enabled, never backwarded
    squared_error(model(x), y).sum().backward()
    engine.clip_and_accumulate(0.5, "sum")
    for name, value in engine.summed_grads().items():
        torch.testing.assert_close(value, expected[name])
    engine.detach()


def test_microbatch_with_partial_last_group() -> None:
    torch.manual_seed(13)
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
    x, y = torch.randn(7, 2, 6), torch.randn(7, 2)
    for reduction in ("mean", "sum"):
        assert_matches_reference(model, x, y, reduction=reduction, microbatch=3, clip_ratio=0.7)


def test_fast_engine_skips_the_ordinary_weight_gradient() -> None:
    # (A gradient hook on a parameter would be refused: the probe is .grad, which autograd
    # fills when it computes the ordinary gradient.)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), _mlp(), nn.LayerNorm(2))
    engine = make_engine(model, "fast")
    out = model(torch.randint(0, 5, (4, 1)))
    assert all(p.requires_grad for p in model.parameters())  # switched off only inside forward
    out.sum().backward()
    assert all(p.grad is None for p in model.parameters())
    engine.clip_and_accumulate(1.0)
    assert all(p.requires_grad for p in model.parameters())
    engine.detach()
    assert all(p.requires_grad for p in model.parameters())


class InPlaceAfterUse(nn.Module):
    """The second layer's input is modified in place after that layer read it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        out = self.second(h)
        h.add_(1.0)  # autograd does not need h (the second layer's weight gradient is skipped)
        return out


def test_input_modified_in_place_is_reported() -> None:
    model = InPlaceAfterUse()
    engine = make_engine(model, "fast")
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="modified in place"):
        engine.clip_and_accumulate(1.0)
    engine.detach()


class FunctionalUse(nn.Module):
    """Uses a child's weight without calling the child: hooks cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.inner.weight)


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_parameter_used_outside_a_watched_call_is_reported(kind) -> None:
    model = FunctionalUse()
    engine = make_engine(model, kind)
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'inner\.weight' received a gradient outside"):
        engine.clip_and_accumulate(1.0)
    engine.detach()


def test_in_place_activation_after_first_layer() -> None:
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    assert_matches_reference(model, torch.randn(6, 3), torch.randn(6, 2))
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(8, 1))
    assert_matches_reference(conv, torch.randn(5, 1, 4, 4), torch.randn(5, 1))


def test_zeroed_gradients_of_unused_parameters_are_accepted() -> None:
    model = Branches()
    engine = make_engine(model, "fast")
    model.unused.weight.grad = torch.zeros_like(model.unused.weight)  # zero_grad(set_to_none=False)
    model(torch.randn(3, 3)).sum().backward()
    assert engine.clip_and_accumulate(1.0).num_examples == 3
    engine.detach()


class TinyDecoder(nn.Module):
    """A causal TransformerDecoderLayer attending to a projected memory."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = nn.Linear(3, 8)
        self.decoder = nn.TransformerDecoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        tgt, memory = x[:, :, :8], self.memory(x[:, :3, 8:])
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.decoder(tgt, memory, tgt_mask=mask, tgt_is_causal=True))


def test_transformer_decoder_matches_reference() -> None:
    torch.manual_seed(17)
    model = TinyDecoder()
    engine = make_engine(model)
    assert engine.kind == "fast", engine.fallback_reason
    engine.detach()
    x, y = torch.randn(4, 5, 11), torch.randn(4, 5, 2)
    assert_matches_reference(model, x, y)


def test_second_engine_on_the_same_model_is_refused() -> None:
    model = _mlp()
    engine = make_engine(model)
    with pytest.raises(ValueError, match="already has an engine"):
        make_engine(model, "vmap")
    engine.detach()
    make_engine(model, "vmap").detach()  # fine once the first is detached


@pytest.mark.parametrize("ghost", [True, False])
def test_attention_ghost_and_direct_routes_match_reference(monkeypatch, ghost) -> None:
    import dpfy.train.grads.rules._bilinear as bilinear
    import dpfy.train.grads.rules.attention as attention

    monkeypatch.setattr(bilinear, "use_ghost", lambda *shape: ghost)
    monkeypatch.setattr(attention, "use_ghost", lambda *shape: ghost)
    torch.manual_seed(18)
    tokens, y = torch.randint(1, 11, (4, 6)), torch.randint(0, 3, (4,))
    assert_matches_reference(TinyTransformer(), tokens, y, loss_fn=cross_entropy, kinds=("fast",))
    x, target = torch.randn(4, 5, 6), torch.randn(4, 5, 1)
    assert_matches_reference(CrossAttention(packed=False), x, target, kinds=("fast",))


class CalledAndReused(nn.Module):
    """A layer called normally, then its weight reused functionally (hooks see only the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(torch.tanh(self.layer(x)), self.layer.weight)


def test_functional_reuse_of_a_watched_parameter_is_reported() -> None:
    model = CalledAndReused()
    engine = make_engine(model, "fast")
    model(torch.randn(4, 3, requires_grad=True)).sum().backward()
    with pytest.raises(RuntimeError, match="received a gradient outside"):
        engine.clip_and_accumulate(1.0)
    engine.detach()


def test_gradients_left_in_p_grad_by_an_optimizer_are_not_mistaken() -> None:
    torch.manual_seed(19)
    model = _mlp()
    engine = make_engine(model, "fast")
    for _ in range(2):  # write_grads leaves p.grad set; the next step must not trip on it
        model(torch.randn(4, 3)).sum().backward()
        engine.clip_and_accumulate(1.0)
        engine.write_grads()
        engine.reset()
    engine.detach()


def test_rows_in_parts_give_the_norms_and_sums_of_the_joined_rows() -> None:
    """Slices of per-example rows, never joined: the same norms, unit sums and weighted sums."""
    torch.manual_seed(5)
    joined = torch.randn(7, 11, dtype=torch.float64)
    rows = Rows((joined[:3], joined[3:5], joined[5:]))
    weights = torch.rand(7, dtype=torch.float64)
    torch.testing.assert_close(rows.joined(), joined, rtol=0, atol=0)
    torch.testing.assert_close(rows.sq_norms(), (joined**2).sum(1))
    torch.testing.assert_close(rows.weighted_sum(weights), weights @ joined)
    singles = layout.Units.consecutive(7, 1)
    assert rows.per_unit(singles) is rows  # one example per unit: the slices stay as they are
    pairs = layout.Units.consecutive(7, 2)  # units of 2 examples straddle the slices
    expected = torch.stack([joined[i : i + 2].sum(0) for i in range(0, 7, 2)])
    torch.testing.assert_close(rows.per_unit(pairs).joined(), expected)
