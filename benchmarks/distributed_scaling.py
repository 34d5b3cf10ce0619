"""One process vs ``torchrun --nproc-per-node 2``: accuracy at the same ε, and step time.

Run: ``.venv/bin/python benchmarks/distributed_scaling.py [--seeds 0 1 2] [--steps 40]``.

Accuracy: ``dpfy train`` on digits with its defaults (mlp, ε = 3, 20 epochs, B = 128, Adam) per
seed, once as one process and once under ``torchrun --nproc-per-node 2`` (gloo, CPU); final
test accuracy and ε are read from each run's ``history.json``. Step time: this script relaunches
itself under torchrun with 1 and 2 processes (one torch thread per process), builds the same
private run on digits for each model and global batch size, and times ``--steps`` full DP steps
(forward, backward, clip, noise shares, all-reduce, update) after 3 warm-up steps, between two
barriers; the mean step time is kept. Repeat the whole run to see the spread on a shared machine.
Results go to ``benchmarks/results/distributed_scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "distributed_scaling.json"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
CASES = [("mlp", 128), ("mlp", 512), ("cnn", 128), ("cnn", 512)]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def accuracy_runs(seeds: list[int], workdir: Path) -> list[dict[str, object]]:
    """`dpfy train` with 1 and 2 processes per seed: final accuracy, ε and wall time."""
    rows = []
    for seed in seeds:
        for procs in (1, 2):
            out = workdir / f"seed{seed}-procs{procs}"
            launcher = [sys.executable] if procs == 1 else [*TORCHRUN, "--nproc-per-node", "2"]
            command = [*launcher, "-m", "dpfy", "train", "--seed", str(seed), "--out", str(out)]
            started = time.perf_counter()
            subprocess.run(command, check=True, env=_env(), capture_output=True, cwd=workdir)
            seconds = time.perf_counter() - started
            last = json.loads((out / "history.json").read_text())["rows"][-1]
            rows.append(
                {
                    "seed": seed,
                    "processes": procs,
                    "test_accuracy": last["test_accuracy"],
                    "epsilon": last["epsilon"],
                    "wall_seconds": round(seconds, 1),
                }
            )
            print(rows[-1], flush=True)
    return rows


def timing_worker(steps: int, out: Path) -> None:
    """Under torchrun: time DP steps of each case; rank 0 writes the medians."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import dpfy
    from dpfy.data.datasets import load_dataset
    from dpfy.data.loader import rest_of_run
    from dpfy.train.distributed import launched_process_group
    from dpfy.train.models import build_model

    torch.set_num_threads(1)
    results = []
    with launched_process_group():
        world = dist.get_world_size() if dist.is_initialized() else 1
        data = load_dataset("digits")
        for model_name, batch in CASES:
            torch.manual_seed(0)
            model = build_model(model_name, data.input_shape, data.num_classes)
            private = dpfy.make_private(
                model, torch.optim.SGD(model.parameters(), lr=0.1), data.train, batch_size=batch,
                steps=steps + 3, noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, seed=0,
            )  # fmt: skip
            started = 0.0
            for index, (x, y) in enumerate(rest_of_run(private.loader)):
                if index == 3:  # after the warm-up steps, all ranks start the clock together
                    _barrier(world)
                    started = time.perf_counter()
                private.optimizer.zero_grad()
                nn.functional.cross_entropy(private.model(x), y).backward()
                private.optimizer.step()
            _barrier(world)
            results.append(
                {
                    "model": model_name,
                    "global_batch_size": batch,
                    "processes": world,
                    "step_ms": round(1000 * (time.perf_counter() - started) / steps, 2),
                }
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            out.write_text(json.dumps(results))


def _barrier(world: int) -> None:
    import torch.distributed as dist

    if world > 1:
        dist.barrier()


def timing_runs(steps: int, workdir: Path) -> list[dict[str, object]]:
    """Relaunch this script under torchrun with 1 and 2 processes."""
    rows = []
    for procs in (1, 2):
        out = workdir / f"timing-{procs}.json"
        command = [
            *TORCHRUN, "--nproc-per-node", str(procs), __file__, "--worker", "--steps", str(steps),
            "--out", str(out),
        ]  # fmt: skip
        subprocess.run(command, check=True, env=_env(), capture_output=True)
        rows.extend(json.loads(out.read_text()))
    for row in rows:
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        timing_worker(args.steps, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        timing = timing_runs(args.steps, workdir)
        accuracy = [] if args.skip_accuracy else accuracy_runs(args.seeds, workdir)
    speedups = {}
    for model_name, batch in CASES:
        by_procs = {
            r["processes"]: r["step_ms"]
            for r in timing
            if r["model"] == model_name and r["global_batch_size"] == batch
        }
        speedups[f"{model_name}-B{batch}"] = round(by_procs[1] / by_procs[2], 2)
    result = {
        "machine": f"{os.cpu_count()} CPU cores, shared with other work; 1 torch thread/process",
        "load_average_at_end": os.getloadavg()[0],
        "timing": timing,
        "speedup_1_to_2_processes": speedups,
        "accuracy": accuracy,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["speedup_1_to_2_processes"]))


if __name__ == "__main__":
    main()
