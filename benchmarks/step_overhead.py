"""Step time and peak memory of one DP-SGD step: non-private SGD vs dpfy fast / vmap (vs Opacus).

Run: ``.venv/bin/python benchmarks/step_overhead.py [--models mlp cnn transformer] [--steps 10]``.
Step times: all methods of a case in one process, interleaved step by step (at least ``--steps``
rounds and at least ``--seconds`` of non-private steps); the ratio of medians is the headline,
the ratio of fastest steps is printed and saved beside it (what the machine allows at best on a
shared host). CPU time per step (all threads of the process) is measured alongside. Peak
memory: two steps after a warm-up step, peak bytes held by torch's allocator above the model,
batch and optimizer state (CUDA: ``max_memory_allocated``, in this process; CPU: the profiler's
allocator events, in one subprocess per (case, method)).
Ratios are against non-private SGD of the same run; Opacus runs in each ``grad_sample_mode``
that works.
``dpfy_*`` steps include clipping, Gaussian noise on every parameter and the SGD update;
``dpfy_fast_nonoise`` leaves out the noise draw to show the engine's own cost. On glibc, the
benchmark has ``malloc`` keep freed memory for the next step
(:func:`dpfy.train.cpu_allocator.keep_freed_memory`, as the ``dpfy`` command does); that is
process-wide and happens before anything is timed, so every method here, non-private included,
runs under it (``DPFY_KEEP_FREED_MEMORY=0``: none does).
Results go to ``benchmarks/results/step_overhead.json`` (``--out``; the README's run, at
default threads, writes ``step_overhead_all_threads.json``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from _step_timing import (
    Bench,
    has_opacus,
    measure_memory,
    memory_in_subprocess,
    timed_against_nonprivate,
)
from _step_timing import step_function as shared_step_function

OPACUS_MODES = ("opacus_hooks", "opacus_functorch", "opacus_ew", "opacus_ghost")
METHODS = ("nonprivate", "dpfy_fast", "dpfy_fast_nonoise", "dpfy_vmap", *OPACUS_MODES)


class MLP(nn.Sequential):
    """inputs-width-width-10: 784-512-512-10 by default.

    32-32-32-10 (the ``tiny`` case) is a step that is all per-step overhead (kernel launches,
    Python), no compute: it stands in, on a CPU, for small models on a fast GPU, where the time
    is the CPU launching kernels (run it with ``--models tiny tiny_cnn``).
    """

    def __init__(self, inputs: int = 784, width: int = 512) -> None:
        super().__init__(
            nn.Flatten(), nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, 10),
        )  # fmt: skip


class CNN(nn.Sequential):
    """conv32 → conv64 + GroupNorm(8) → fc128 → 10 on 28×28 by default.

    conv4 → conv8 + GroupNorm(2) → fc16 on 8×8 is the ``tiny_cnn`` case, the tiny MLP's twin.
    """

    def __init__(
        self, widths: tuple[int, int, int] = (32, 64, 128), side: int = 28, groups: int = 8
    ) -> None:
        c1, c2, hidden = widths
        super().__init__(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.GroupNorm(groups, c2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(c2 * (side // 4) ** 2, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )  # fmt: skip


class Transformer(nn.Module):
    """Vocabulary 10 000, d_model 256, 2 layers, 4 heads, sequence 64, mean-pooled classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10_000, 256)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(256, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


#: Each case's model and a batch of its inputs (labels: 10 classes).
CASES: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mlp": lambda: (MLP(), torch.randn(256, 1, 28, 28)),
    "cnn": lambda: (CNN(), torch.randn(256, 1, 28, 28)),
    "transformer": lambda: (Transformer(), torch.randint(0, 10_000, (64, 64))),
    "tiny": lambda: (MLP(32, 32), torch.randn(8, 32)),
    "tiny_cnn": lambda: (CNN((4, 8, 16), side=8, groups=2), torch.randn(8, 1, 8, 8)),
}


def make_case(name: str, device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Model, inputs and labels of one benchmark case."""
    torch.manual_seed(0)
    model, x = CASES[name]()
    return model.to(device), x.to(device), torch.randint(0, 10, (x.shape[0],), device=device)


def make_bench(name: str, device: str) -> Bench:
    """One benchmark case as the shared step machinery takes it."""
    return Bench(*make_case(name, device))


def step_function(method: str, model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A closure doing one training step (forward, backward, clip, noise, update) on (x, y)."""
    bench = Bench(model, None, torch.empty(0))  # the batch is the call's: set before each step
    step = shared_step_function(method, bench)

    def run(x: torch.Tensor, y: torch.Tensor) -> None:
        bench.inputs, bench.target = x, y
        step()

    return run


def main() -> None:
    """Time methods per case in one process (see ``LIGHT``); memory in one subprocess each."""
    from dpfy.train.cpu_allocator import keep_freed_memory

    keep_freed_memory()  # process-wide, before anything is timed (see the module docstring)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn", "transformer"], choices=list(CASES)
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--steps", type=int, default=10, help="fewest interleaved rounds")
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="least non-private time per case (s)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results") / "step_overhead.json"
    )
    parser.add_argument("--memory-of", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        case, method = args.memory_of
        print(
            json.dumps({"peak": measure_memory(make_bench(case, args.device), method, args.device)})
        )
        return
    methods = [m for m in args.methods if not m.startswith("opacus") or has_opacus()]
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    peaks = {}
    for case in args.models:
        for method in methods:
            peak = peak_memory(case, method, args)
            if peak is not None:
                peaks[case, method] = peak
    rows = []
    for case in args.models:
        base_peak = peaks.get((case, "nonprivate"))
        timed = timed_against_nonprivate(
            lambda case=case: make_bench(case, args.device), methods, LIGHT, args.steps,
            args.seconds, args.device, case,
        )  # fmt: skip
        for method, t, base in timed:
            peak = peaks.get((case, method))
            row = {"case": case, "method": method, "seconds": t["median"], "peak": peak}
            row["time_ratio"] = t["median"] / base["median"]
            row["min_time_ratio"] = t["min"] / base["min"]
            row["cpu_time_ratio"] = t["cpu"] / base["cpu"]
            row["memory_ratio"] = peak / base_peak if peak and base_peak else None
            rows.append(row)
            memory = (
                f"peak +{peak / 2**20:7.1f} MiB ×{row['memory_ratio']:5.2f}" if peak else "peak ?"
            )
            timing = (
                f"{t['median'] * 1e3:8.1f} ms ×{row['time_ratio']:6.2f} "
                f"(fastest ×{row['min_time_ratio']:5.2f}, CPU ×{row['cpu_time_ratio']:5.2f})"
            )
            print(f"{case:12s} {method:18s} {timing}   {memory}", flush=True)
    if any(m.startswith("opacus") for m in args.methods) and not has_opacus():
        print("opacus: skipped (not installed)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads()}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


def peak_memory(case: str, method: str, args: argparse.Namespace) -> int | None:
    """Peak memory of ``method``'s steps: in a subprocess of its own on a CPU; here on a GPU.

    A CPU's profiler counts the whole process, so each method gets a fresh one; CUDA's peak
    statistics are reset per measurement and count live tensors only, so no process is needed
    (each would spend seconds starting CUDA). None: the method could not run.
    """
    if args.device == "cuda":
        try:
            return measure_memory(make_bench(case, args.device), method, args.device)
        except Exception:  # a competitor that cannot run this model is reported when timed
            return None
    return memory_in_subprocess(__file__, case, method, args.device, args.threads)


#: Methods timed together with non-private SGD; every other method is timed in a round of its own
#: with non-private SGD (see :func:`_step_timing.timed_against_nonprivate`): a step that allocates
#: a gigabyte (Opacus's per-sample gradients, vmap) would slow whatever runs next — dpfy's noise
#: worker included — and measure the neighbour, not the method.
LIGHT = ("nonprivate", "dpfy_fast", "dpfy_fast_nonoise")


if __name__ == "__main__":
    main()
