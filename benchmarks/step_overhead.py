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
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

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


def step_function(method: str, model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A closure doing one training step (forward, backward, clip, noise, update)."""
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if method == "nonprivate":

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            optimizer.step()

        return step
    if method.startswith("dpfy"):
        return _dpfy_step(method, model, optimizer, criterion)
    return _opacus_step(method.removeprefix("opacus_"), model, optimizer, criterion)


def _opacus_step(
    mode: str, model: nn.Module, optimizer: torch.optim.Optimizer, criterion: nn.Module
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Opacus's own private step in one ``grad_sample_mode`` (hooks, functorch, ew, ghost).

    Built through ``PrivacyEngine.make_private`` as its documentation shows; ghost clipping
    returns a wrapped criterion whose ``backward`` runs its two passes.
    """
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator
    from torch.utils.data import DataLoader, TensorDataset

    if not ModuleValidator.is_valid(model):  # e.g. nn.MultiheadAttention → Opacus's own
        model = ModuleValidator.fix(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.zeros(256, 1)), batch_size=256)
    made = PrivacyEngine(accountant="rdp").make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
        **({"criterion": criterion} if mode == "ghost" else {}),
    )
    private_model, dp_opt = made[0], made[1]
    loss_fn = made[2] if mode == "ghost" else criterion

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        dp_opt.expected_batch_size = x.shape[0]
        dp_opt.zero_grad(set_to_none=True)
        loss_fn(private_model(x), y).backward()
        dp_opt.step()

    return step


def _dpfy_step(
    method: str, model: nn.Module, optimizer: torch.optim.Optimizer, criterion: nn.Module
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """dpfy's real private step: the engine inside DPOptimizer, with its ledger.

    ``dpfy_fast_nonoise`` drives the engine alone (clip, sum at 1/B, SGD) to show its own cost.
    """
    from dpfy.data.provenance import Provenance
    from dpfy.plan.resolvers import PlanRequest, make_plan
    from dpfy.train.grads import make_engine
    from dpfy.train.ledger import PrivacyLedger
    from dpfy.train.optim import DPOptimizer

    kind = method.removeprefix("dpfy_").removesuffix("_nonoise")
    engine = make_engine(model, kind)
    if method.endswith("_nonoise"):

        def engine_step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            criterion(model(x), y).backward()
            engine.clip_and_accumulate(1.0, "mean", scale=1.0 / x.shape[0])
            for name, total in engine.summed_grads().items():  # the sums themselves, as dpfy's
                engine.params[name].grad = total  # private step hands them over
            optimizer.step()
            engine.reset()

        return engine_step
    ledger = PrivacyLedger(1e-5)
    plan = make_plan(
        PlanRequest(
            records=100_000, batch_size=256, delta=1e-5, max_grad_norm=1.0, steps=10**8,
            noise_multiplier=1.0,
        )
    )  # fmt: skip
    batches = Provenance()  # the benchmark is its own loader: it publishes each batch it feeds
    private = DPOptimizer(
        optimizer, engine, ledger, plan.sampling_record(), plan, provenance=batches
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        batches.publish(x.shape[0])
        private.zero_grad()
        criterion(model(x), y).backward()
        private.step()

    return step


def allocator_peak_bytes(run: Callable[[], None]) -> int:
    """Peak of bytes held by torch's CPU allocator during ``run``, above what it held before.

    Read from the profiler's memory events (each carries the running total since profiling
    began), so it counts tensors only — not the interpreter, libraries or freed-but-cached pages
    that make peak RSS noisy.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [
        e["args"]["Total Allocated"]
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]
    return max([0, *totals])


def measure_memory(case: str, method: str, device: str) -> int:
    """Peak memory of training steps beyond the model, batch and optimizer state (subprocess)."""
    model, x, y = make_case(case, device)
    step = step_function(method, model)
    step(x, y)  # warm-up: optimizer state and lazily built buffers exist before measuring
    for param in model.parameters():
        param.grad = None

    def run() -> None:
        for _ in range(2):
            step(x, y)

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return allocator_peak_bytes(run)


def measure_times(
    case: str, methods: list[str], steps: int, seconds: float, device: str
) -> dict[str, dict[str, float]]:
    """Fastest and median wall time and median CPU time per method, methods interleaved.

    Interleaving makes machine load hit all methods alike; the number of rounds grows until the
    non-private steps alone took ``seconds`` (cheap models get many more samples), within ten
    times that in all.
    """
    model, x, y = make_case(case, device)
    runs = {}
    for m in methods:
        try:
            runs[m] = step_function(m, copy.deepcopy(model))
            runs[m](x, y)  # warm-up
        except Exception as error:  # a competitor that cannot run this model is reported
            print(f"{case:12s} {m:18s} failed: {type(error).__name__}: {error}"[:200], flush=True)
            runs.pop(m, None)
    methods = list(runs)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    rounds, began = 0, time.perf_counter()
    while rounds < steps or (
        sum(times["nonprivate"]) < seconds and time.perf_counter() - began < 10 * seconds
    ):
        rounds += 1
        for m in methods:
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[m](x, y)
            sync()
            times[m].append(time.perf_counter() - start)
            cpu[m].append(time.process_time() - start_cpu)
    return {
        m: {"min": min(t), "median": statistics.median(t), "cpu": statistics.median(cpu[m])}
        for m, t in times.items()
    }


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
        print(json.dumps({"peak": measure_memory(*args.memory_of, args.device)}))
        return
    methods = [m for m in args.methods if not m.startswith("opacus") or _has_opacus()]
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
        for method, t, base in timed_against_nonprivate(case, methods, args):
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
    if any(m.startswith("opacus") for m in args.methods) and not _has_opacus():
        print("opacus: skipped (not installed)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads()}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


def peak_memory(case: str, method: str, args: argparse.Namespace) -> int | None:
    """:func:`measure_memory` in a subprocess of its own on a CPU; here on a GPU.

    A CPU's profiler counts the whole process, so each method gets a fresh one; CUDA's peak
    statistics are reset per measurement and count live tensors only, so no process is needed
    (each would spend seconds starting CUDA). None: the method could not run.
    """
    if args.device == "cuda":
        try:
            return measure_memory(case, method, args.device)
        except Exception:  # a competitor that cannot run this model is reported when timed
            return None
    command = [sys.executable, __file__, "--memory-of", case, method,
               "--device", args.device, "--threads", str(args.threads)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


#: Methods timed together with non-private SGD; every other method is timed in a round of its own
#: with non-private SGD: a step that allocates a gigabyte (Opacus's per-sample gradients, vmap)
#: leaves the caches cold and the kernel reclaiming pages on the other core, which would slow
#: whatever runs next — dpfy's noise worker included — and measure the neighbour, not the method.
LIGHT = ("nonprivate", "dpfy_fast", "dpfy_fast_nonoise")


def timed_against_nonprivate(
    case: str, methods: list[str], args: argparse.Namespace
) -> list[tuple[str, dict[str, float], dict[str, float]]]:
    """(method, its times, the non-private times of the same interleaved rounds) per method."""
    light = [m for m in methods if m in LIGHT]
    groups = [light] + [["nonprivate", m] for m in methods if m not in LIGHT]
    out = []
    for group in groups:
        times = measure_times(case, group, args.steps, args.seconds, args.device)
        keep = group if group is light else group[1:]  # non-private: from the first round only
        out += [(m, times[m], times["nonprivate"]) for m in keep if m in times]
    return out


def _has_opacus() -> bool:
    """Whether Opacus can be imported."""
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
