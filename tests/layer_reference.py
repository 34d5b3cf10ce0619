"""The per-example reference for the layer tests: each example alone, backward, clip, sum.

Shared by tests/test_layers_*.py. The reference knows nothing of the engines: it runs the model on
one example at a time (``example_loss(i)``), takes that example's gradient of every trainable
parameter, clips it to C and sums (guide alg. 1); microbatches average their examples first
(guide alg. 3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from dpfy.train.grads import make_engine


def reference(
    model: nn.Module,
    example_loss: Callable[[int], Tensor],
    n: int,
    clip: float,
    microbatch: int | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Clipped sum and unit norms from one backward pass per example."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    per_example = []
    for i in range(n):
        model.zero_grad(set_to_none=True)
        example_loss(i).backward()
        per_example.append(
            {
                k: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for k, p in params.items()
            }
        )
    model.zero_grad(set_to_none=True)
    k = microbatch or 1
    units = [per_example[i : i + k] for i in range(0, n, k)]
    averaged = [{name: sum(g[name] for g in unit) / len(unit) for name in params} for unit in units]
    norms = torch.stack(
        [torch.sqrt(sum(g.square().sum() for g in unit.values())) for unit in averaged]
    )
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    for unit, norm in zip(averaged, norms, strict=True):
        factor = min(1.0, clip / float(norm)) if float(norm) > 0 else 1.0
        for name in params:
            total[name] += factor * unit[name]
    return total, norms


def engine_run(
    model: nn.Module,
    kind: str,
    batch_losses: Callable[[], Tensor],
    clip: float,
    reduction: str = "sum",
    microbatch: int | None = None,
    **make_kwargs: object,
) -> tuple[dict[str, Tensor], Tensor, str]:
    """One forward and backward with an engine attached: its clipped sum, norms and kind."""
    engine = make_engine(model, kind, **make_kwargs)
    try:
        losses = batch_losses()
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
        result = engine.clip_and_accumulate(clip, reduction, microbatch_size=microbatch)
        return engine.summed_grads(), result.norms, engine.kind
    finally:
        engine.detach()


def relative_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """max over parameters of ‖got − want‖ / ‖want‖ (the figure the report quotes).

    A parameter whose true gradient is zero but for rounding (attention's key bias) is measured
    against a millionth of the whole gradient's norm instead of its own.
    """
    assert got.keys() == want.keys()
    whole = float(torch.sqrt(sum(w.square().sum() for w in want.values())))
    return max(
        float((got[k] - want[k]).norm()) / max(float(want[k].norm()), 1e-6 * whole, 1e-30)
        for k in want
    )


def assert_exact(
    model: nn.Module,
    example_loss: Callable[[int], Tensor],
    batch_losses: Callable[[], Tensor],
    n: int,
    *,
    kind: str = "auto",
    reduction: str = "sum",
    microbatch: int | None = None,
    clip_ratio: float = 0.5,
    **make_kwargs: object,
) -> str:
    """The engine's clipped sum and norms equal the reference's (float64); returns its kind.

    C is a fraction of the median unclipped norm, so that some units are clipped and some not.
    """
    _, free = reference(model, example_loss, n, float("inf"), microbatch)
    clip = clip_ratio * float(free.median()) + 1e-12
    want, want_norms = reference(model, example_loss, n, clip, microbatch)
    got, norms, used = engine_run(
        model, kind, batch_losses, clip, reduction, microbatch, **make_kwargs
    )
    torch.testing.assert_close(norms, want_norms, rtol=1e-7, atol=1e-9)
    assert relative_error(got, want) < 1e-7, relative_error(got, want)
    return used
