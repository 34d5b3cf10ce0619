"""Both engines under torch.autocast (bf16, fp16) and on bf16 weights, against a per-example loop.

The loop runs each example under the same autocast (or on the same bf16 weights). Both sides
round at every half-precision operation, and differently (batched and single-example kernels;
the fast engine forms its products in float32 from the captured tensors), so the comparison
holds to the precision's rounding, not to float32's. The tolerance is 4 units of roundoff u of
the half-precision dtype (u = 2⁻⁸ for bf16, 2⁻¹¹ for fp16): the largest gap measured on these
models is about 1.2 u (bf16 weights, whose finished sums are themselves rounded to bf16), while a
wrong norm, a lost term or a rounded clip factor at C between the norms moves the sum by
percents.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from dpfy.train.grads import make_engine

pytest.importorskip("transformers")

from test_hf_models import assert_exact, batch_of, lora_bert, model_of

#: 4 units of roundoff of each half-precision dtype (see the module docstring).
HALF_RTOL = {torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}

FAMILIES = ["bert-seq-cls", "bert-mlm", "gpt2-lm", "lora"]


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return lora_bert() if family == "lora" else model_of(family, "full")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_autocast_matches_a_per_example_loop_under_the_same_autocast(family, dtype) -> None:
    context = functools.partial(torch.autocast, "cpu", dtype=dtype)
    model = _model(family)
    assert_exact(model, batch_of(family), ("fast", "vmap"), HALF_RTOL[dtype], context)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_weights_match_a_per_example_loop_on_the_same_weights(family) -> None:
    model = _model(family).to(torch.bfloat16)
    assert_exact(model, batch_of(family), ("fast", "vmap"), HALF_RTOL[torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_autocast_matches_a_per_example_loop(dtype) -> None:
    context = functools.partial(torch.autocast, "cuda", dtype=dtype)
    model = _model("gpt2-lm").cuda()
    batch = {k: v.cuda() for k, v in batch_of("gpt2-lm").items()}
    assert_exact(model, batch, ("fast", "vmap"), HALF_RTOL[dtype], context)


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_sums_of_bf16_parameters_accumulate_in_float32(kind) -> None:
    """300 clipped unit gradients of 1.0 sum to 300; a bf16 sum stops at 256 (spacing 2 there)."""
    model = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    engine = make_engine(model, kind)
    for _ in range(300):  # 300 physical batches of one example form one logical batch
        model(torch.ones(1, 1, dtype=torch.bfloat16)).sum().backward()
        engine.clip_and_accumulate(1.0, "sum")
    total = engine.summed_grads()["weight"]
    engine.detach()
    assert total.dtype == torch.bfloat16 and float(total) == 300.0


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_clipping_inside_an_autocast_block_computes_as_outside_it(kind) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(6, 5)
    sums = []
    for inside in (False, True):
        engine = make_engine(model, kind)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).square().sum().backward()
            if inside:
                engine.clip_and_accumulate(0.5, "sum")
        if not inside:
            engine.clip_and_accumulate(0.5, "sum")
        sums.append(engine.summed_grads())
        engine.detach()
    for name, value in sums[0].items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(sums[1][name], value, rtol=0.0, atol=0.0)
