"""What the step benchmarks share: one training step per method, interleaved timing, peak memory.

``step_overhead.py`` (small stand-in models) and ``finetune_speed.py`` (pretrained-model
fine-tuning) time the same methods the same way, so the ratios of both tables mean the same
thing. A :class:`Bench` is a model, one batch and how a loss comes from them; each method turns
it into a closure doing one whole training step (forward, backward, clip, noise, update):

- ``nonprivate``: plain SGD;
- ``dpfy_<engine>``: dpfy's :class:`~dpfy.train.optim.DPOptimizer` with its ledger, the engine
  made by ``make_engine(model, engine)`` (``auto``, ``fast`` or ``vmap``); ``dpfy_fast_nonoise``
  drives the engine alone (clip, sum at 1/B, SGD) to show its own cost;
- ``opacus_<mode>``: Opacus's ``PrivacyEngine.make_private`` in that ``grad_sample_mode``.

Times: all methods of a group in one process, interleaved step by step, so machine load hits
them alike; the ratio of medians is the headline. CPU peak memory: the profiler's allocator
events (tensors only), in a fresh subprocess per (case, method), since the profiler counts the
whole process; on CUDA ``max_memory_allocated`` in this process.
"""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

Step = Callable[[], None]


def call_model(model: nn.Module, inputs: Any) -> torch.Tensor:
    """The model's output on ``inputs``: positional for a tensor, keywords for a dict."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def apply_criterion(
    criterion: Callable[..., torch.Tensor], output: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The loss of one batch: the criterion on the output and the labels."""
    return criterion(output, target)


@dataclass
class Bench:
    """A model, one batch of its inputs and targets, and how a loss comes from them.

    The steps read ``inputs`` and ``target`` at each call, so a caller may swap the batch.

    ``loss`` receives the criterion (``CrossEntropyLoss``, or Opacus's ghost-clipping wrapper of
    it), the output of ``forward`` and the targets.
    """

    model: nn.Module
    inputs: Any
    target: torch.Tensor
    forward: Callable[[nn.Module, Any], torch.Tensor] = call_model
    loss: Callable[..., torch.Tensor] = apply_criterion


def step_function(method: str, bench: Bench) -> Step:
    """A closure doing one training step of ``method`` on ``bench``'s model and batch."""
    model = bench.model
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    if method == "nonprivate":

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            bench.loss(criterion, bench.forward(model, bench.inputs), bench.target).backward()
            optimizer.step()

        return step
    if method.startswith("dpfy"):
        return _dpfy_step(method, bench, optimizer, criterion)
    return _opacus_step(method.removeprefix("opacus_"), bench, optimizer, criterion)


def _opacus_step(
    mode: str, bench: Bench, optimizer: torch.optim.Optimizer, criterion: nn.Module
) -> Step:
    """Opacus's own private step in one ``grad_sample_mode`` (hooks, functorch, ew, ghost).

    Built through ``PrivacyEngine.make_private`` as its documentation shows; ghost clipping
    returns a wrapped criterion whose ``backward`` runs its two passes.
    """
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator
    from torch.utils.data import DataLoader, TensorDataset

    model = bench.model
    if not ModuleValidator.is_valid(model):  # e.g. nn.MultiheadAttention → Opacus's own
        model = ModuleValidator.fix(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
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

    def step() -> None:
        dp_opt.expected_batch_size = bench.target.shape[0]
        dp_opt.zero_grad(set_to_none=True)
        output = bench.forward(private_model, bench.inputs)
        bench.loss(loss_fn, output, bench.target).backward()
        dp_opt.step()

    return step


def _dpfy_step(
    method: str, bench: Bench, optimizer: torch.optim.Optimizer, criterion: nn.Module
) -> Step:
    """dpfy's real private step: the engine inside DPOptimizer, with its ledger.

    ``dpfy_fast_nonoise`` drives the engine alone (clip, sum at 1/B, SGD) to show its own cost.
    """
    from dpfy.data.provenance import Provenance
    from dpfy.plan.variants import PlanRequest, make_plan
    from dpfy.train.grads import make_engine
    from dpfy.train.ledger import PrivacyLedger
    from dpfy.train.optim import DPOptimizer

    model = bench.model
    kind = method.removeprefix("dpfy_").removesuffix("_nonoise")
    engine = make_engine(model, kind)

    def loss() -> torch.Tensor:
        return bench.loss(criterion, bench.forward(model, bench.inputs), bench.target)

    if method.endswith("_nonoise"):

        def engine_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss().backward()
            engine.clip_and_accumulate(1.0, "mean", scale=1.0 / bench.target.shape[0])
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

    def step() -> None:
        batches.publish(bench.target.shape[0])
        private.zero_grad()
        loss().backward()
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


def measure_memory(bench: Bench, method: str, device: str) -> int:
    """Peak memory of two training steps beyond the model, batch and optimizer state."""
    step = step_function(method, bench)
    step()  # warm-up: optimizer state and lazily built buffers exist before measuring
    for param in bench.model.parameters():
        param.grad = None

    def run() -> None:
        for _ in range(2):
            step()

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return allocator_peak_bytes(run)


def memory_in_subprocess(
    script: str, case: str, method: str, device: str, threads: int
) -> int | None:
    """``script --memory-of case method`` in a fresh process: its peak, or None if it failed.

    A CPU's profiler counts the whole process, so each method gets a fresh one. The script must
    answer ``--memory-of`` by printing ``{"peak": bytes}`` as its last line.
    """
    command = [sys.executable, script, "--memory-of", case, method,
               "--device", device, "--threads", str(threads)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


Times = dict[str, dict[str, float]]


def measure_times(
    make: Callable[[], Bench],
    methods: list[str],
    steps: int,
    seconds: float,
    device: str,
    label: str,
    errors: dict[str, str] | None = None,
    only_against: bool = False,
) -> Times:
    """Fastest and median wall time and median CPU time per method, methods interleaved.

    Interleaving makes machine load hit all methods alike; the number of rounds grows until the
    non-private steps alone took ``seconds`` (cheap models get many more samples), within ten
    times that in all. A method that cannot run is left out, its error printed and, if given,
    put in ``errors``; ``only_against``: the non-private steps are there only to compare with,
    so nothing is timed once all other methods failed.
    """
    bench = make()
    runs = {}
    for m in methods:
        try:
            runs[m] = step_function(m, replace(bench, model=copy.deepcopy(bench.model)))
            runs[m]()  # warm-up
        except Exception as error:  # a competitor that cannot run this model is reported
            message = f"{type(error).__name__}: {error}"
            print(f"{label:12s} {m:18s} failed: {message}"[:200], flush=True)
            if errors is not None:
                errors[m] = message
            runs.pop(m, None)
    if only_against and list(runs) == ["nonprivate"]:
        return {}  # the method it was to be compared with failed: nothing to time
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
            runs[m]()
            sync()
            times[m].append(time.perf_counter() - start)
            cpu[m].append(time.process_time() - start_cpu)
    return {
        m: {"min": min(t), "median": statistics.median(t), "cpu": statistics.median(cpu[m]),
            "rounds": len(t)}
        for m, t in times.items()
    }  # fmt: skip


def timed_against_nonprivate(
    make: Callable[[], Bench],
    methods: list[str],
    light: tuple[str, ...],
    steps: int,
    seconds: float,
    device: str,
    label: str,
    errors: dict[str, str] | None = None,
) -> list[tuple[str, dict[str, float], dict[str, float]]]:
    """(method, its times, the non-private times of the same interleaved rounds) per method.

    The ``light`` methods are timed together with non-private SGD; every other method in a round
    of its own with non-private SGD: a step that allocates a gigabyte (per-sample gradients,
    vmap) leaves the caches cold and the kernel reclaiming pages on the other core, which would
    slow whatever runs next and measure the neighbour, not the method.
    """
    group_light = [m for m in methods if m in light]
    groups = [group_light] + [["nonprivate", m] for m in methods if m not in light]
    out = []
    for group in groups:
        alone = group is not group_light
        times = measure_times(make, group, steps, seconds, device, label, errors, alone)
        keep = group if group is group_light else group[1:]  # non-private: first round only
        out += [(m, times[m], times["nonprivate"]) for m in keep if m in times]
    return out


def has_opacus() -> bool:
    """Whether Opacus can be imported."""
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True
