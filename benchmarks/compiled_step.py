"""What ``torch.compile`` (CPU inductor) gives a private step on static-shape batches.

Times, interleaved step by step against non-private SGD of the same model and batch:

- ``dpfy_fast``: dpfy's hooked step (fast engine inside ``DPOptimizer``, as ``step_overhead.py``
  times it);
- ``dpfy_compiled``: dpfy's shipped compiled step (:class:`~dpfy.train.compiled_step
  .CompiledStep`, ``private.compiled_step()``) on the same B-row batch (a static-shape sampler:
  ``fixed-size``), with every guard, the noise mechanism and the ledger of a real step;
- ``dpfy_compiled_eager``: the same step with ``compile=False`` (``torch.func`` alone);
- ``functional_compiled``: the bare compiled clip-and-sum with seeded noise and SGD and nothing
  else — the floor the shipped step's guards and ledger add to.

Each method is timed against non-private SGD in a pairing of its own (the two interleaved in a
fresh random order each round), so a heavy method never evicts another's caches, as in a run
where one method trains. It prints the compile time (paid once per batch shape) and checks,
before timing, that a seeded compiled step gives the eager step's parameters to float tolerance
(the batch's last rows padding). Medians are the headline on a quiet machine; on a shared host
the fastest steps are the steadier figure, and both are printed. "Cold" compile time is the
first compile of the process with inductor's on-disk cache as found (empty on a new machine); a
later process reuses the cache.

Run: ``.venv/bin/python benchmarks/compiled_step.py --models tiny tiny_cnn mlp cnn transformer
[--rounds 300] [--threads 1]`` (results: ``benchmarks/results/compiled_step.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from step_overhead import make_case, step_function

Step = Callable[[], None]


def functional_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    real: int,
    *,
    compiled: bool,
    seed: int = 0,
    clip: float = 1.0,
    sigma: float = 1.0,
) -> tuple[Step, float]:
    """One private step as a pure function of the parameters, and its compile time (s)."""
    ce = nn.functional.cross_entropy

    def loss_one(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor):
        return ce(functional_call(model, params, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    def clipped_sum(params, xs, ys, weights):
        per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, xs, ys)
        sq = sum(g.flatten(1).square().sum(1) for g in per_example.values())
        factors = (clip / sq.sqrt()).clamp(max=1.0) * weights  # padding rows: weight 0
        return {k: torch.tensordot(factors, g, dims=1) for k, g in per_example.items()}

    fn = torch.compile(clipped_sum, dynamic=False) if compiled else clipped_sum
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    noise = torch.Generator().manual_seed(seed)
    weights = torch.zeros(x.shape[0])
    weights[:real] = 1.0 / real  # ÷ the expected batch size (here the real rows, for the check)
    std = sigma * clip / real

    def step() -> None:
        sums = fn({k: v.detach() for k, v in params.items()}, x, y, weights)
        for name, param in params.items():
            param.grad = sums[name] + std * torch.randn(param.shape, generator=noise)
        optimizer.step()

    start = time.perf_counter()
    if compiled:
        fn({k: v.detach() for k, v in params.items()}, x, y, weights)  # compile now
    return step, time.perf_counter() - start


def check_equal(case: str) -> tuple[float, float]:
    """Largest parameter difference after 3 seeded steps, compiled against eager (the batch's
    last 2 rows padding), and the compile time of this first, cold compile (s)."""
    results, cold = [], 0.0
    for compiled in (False, True):
        model, x, y = make_case(case, "cpu")
        step, seconds = functional_step(model, x, y, x.shape[0] - 2, compiled=compiled, seed=7)
        cold = max(cold, seconds)
        for _ in range(3):
            step()
        results.append([p.detach().clone() for p in model.parameters()])
    worst = max(float((a - b).abs().max()) for a, b in zip(*results, strict=True))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return worst, cold


def shipped_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, compiled: bool) -> Step:
    """dpfy's compiled step as shipped, fed (x, y) as the run's loader would hand it out.

    The benchmark is its own loader (as ``step_overhead``'s dpfy steps are): it publishes and
    hands out the same tensors each step, with a fixed-size plan so every batch has B rows.
    """
    from dpfy.data.provenance import Provenance
    from dpfy.plan.variants import PlanRequest, make_plan
    from dpfy.train.compiled_step import CompiledStep
    from dpfy.train.grads import make_engine
    from dpfy.train.ledger import PrivacyLedger
    from dpfy.train.noise.source import TorchNoise
    from dpfy.train.optim import DPOptimizer

    plan = make_plan(
        PlanRequest(
            records=100_000, batch_size=x.shape[0], delta=1e-5, max_grad_norm=1.0, steps=10**8,
            noise_multiplier=1.0, sampler="fixed-size",
        )
    )  # fmt: skip
    batches = Provenance()
    ledger = PrivacyLedger(1e-5, relation=plan.relation, accountant=plan.accountant)
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), make_engine(model, "fast"), ledger,
        plan.sampling_record(), plan, provenance=batches, noise=TorchNoise(0),
    )  # fmt: skip
    step = CompiledStep(model, optimizer, nn.CrossEntropyLoss(), compile=compiled)

    def run() -> None:
        batches.publish(x.shape[0])
        batches.hold((x, y))
        step(x, y)

    return run


def time_case(case: str, rounds: int) -> dict[str, object]:
    """Each method's ratio to non-private SGD (median and fastest), timed in its own pairing."""
    model, x, y = make_case(case, "cpu")
    methods: dict[str, Step] = {}
    nonprivate = step_function("nonprivate", make_case(case, "cpu")[0])
    private = step_function("dpfy_fast", make_case(case, "cpu")[0])
    methods["nonprivate"] = lambda: nonprivate(x, y)
    methods["dpfy_fast"] = lambda: private(x, y)
    methods["dpfy_compiled_eager"] = shipped_step(make_case(case, "cpu")[0], x, y, compiled=False)
    compiled = shipped_step(make_case(case, "cpu")[0], x, y, compiled=True)
    start = time.perf_counter()
    compiled()  # compiles now
    compile_seconds = time.perf_counter() - start
    methods["dpfy_compiled"] = compiled
    methods["functional_compiled"], _ = functional_step(model, x, y, x.shape[0], compiled=True)
    for run in methods.values():  # warm-up
        for _ in range(10):
            run()
    median: dict[str, float] = {"nonprivate": 1.0}
    fastest: dict[str, float] = {"nonprivate": 1.0}
    base: list[float] = []
    for name in [m for m in methods if m != "nonprivate"]:
        pair = paired_times(methods["nonprivate"], methods[name], rounds)
        median[name] = statistics.median(pair[1]) / statistics.median(pair[0])
        fastest[name] = min(pair[1]) / min(pair[0])
        base += pair[0]
    return {
        "case": case,
        "compile_seconds_cached": compile_seconds,
        "nonprivate_ms": statistics.median(base) * 1e3,
        "median_ratio": median,
        "fastest_ratio": fastest,
    }


def paired_times(nonprivate: Step, private: Step, rounds: int) -> tuple[list[float], list[float]]:
    """Step times of non-private SGD and one private method, interleaved in a fresh random
    order each round: only these two share the caches, as in a real run only one method does."""
    times: tuple[list[float], list[float]] = ([], [])
    shuffler = random.Random(0)
    for _ in range(rounds):
        order = [0, 1]
        shuffler.shuffle(order)
        for which in order:
            start = time.perf_counter()
            (nonprivate, private)[which]()
            times[which].append(time.perf_counter() - start)
    return times


def main() -> None:
    """Check equality, then time each case; print and save the ratios."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny", "tiny_cnn"])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results") / "compiled_step.json"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for case in args.models:
        worst, cold = check_equal(case)
        row = time_case(case, args.rounds)
        row["compiled_vs_eager_max_abs_difference"] = worst
        row["compile_seconds_cold"] = cold
        rows.append(row)
        shown = ", ".join(
            f"{m} ×{row['median_ratio'][m]:.2f} (fastest ×{row['fastest_ratio'][m]:.2f})"
            for m in row["median_ratio"]
        )
        print(
            f"{case:9s} compile {cold:5.1f} s cold, {row['compile_seconds_cached']:4.1f} s cached"
            f" | non-private "
            f"{row['nonprivate_ms']:.2f} ms | {shown} | compiled = eager within {worst:.1e}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
