"""FSDP2 vs DDP vs one process on the CPU: DP-SGD steps per second and memory per rank.

Run: ``.venv/bin/python benchmarks/fsdp.py [--width 1024] [--depth 4] [--batch 64] [--steps 20]
[--threads 1]``.

The model is an MLP of ``depth`` square ``width``-wide linear layers (4 × 1024² ≈ 4.2 M
parameters, 16.8 MB in float32) trained with Adam, so parameters, gradients and the two Adam
moments are about 67 MB per full replica — enough for sharding to show. Each mode builds the
same private run (``dpfy.make_private``, fast engine, global expected batch ``--batch``,
σ = 1, C = 1) and times ``--steps`` full private steps (forward, backward, per-example
clipping, noise, aggregation, update) after 3 warm-up steps:

- ``one``: one process, the plain model;
- ``ddp``: 2 processes (gloo), the model wrapped in ``DistributedDataParallel``;
- ``fsdp``: 2 processes (gloo), every linear layer and the root ``fully_shard``-ed.

Per rank it records steps/s, the peak resident memory the training added (``ru_maxrss`` after
training minus before the model was built) and the training state it holds (parameters, Adam
moments, as this rank stores them). The load average before and after is recorded too: timing on
a shared machine is only comparable within one run. Results go to
``benchmarks/results/fsdp.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fsdp.json"
WARMUP = 3


def _model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters and optimizer state this rank stores (its shards, if sharded)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _run(mode: str, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch.distributed.checkpoint.state_dict
    import torch.distributed.fsdp

    import dpfy
    from dpfy.train import builder  # noqa: F401  (dpfy's lazy imports, done before measuring)

    torch.set_num_threads(args.threads)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = _model(args.width, args.depth)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    n = args.batch * (WARMUP + args.steps)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(n, args.width, generator=generator), torch.randint(0, 10, (n,))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    private = dpfy.make_private(
        model, optimizer, data, batch_size=args.batch, steps=WARMUP + args.steps,
        noise_multiplier=1.0, delta=1e-6, max_grad_norm=1.0, engine="fast", seed=rank,
    )  # fmt: skip
    loss_fn = nn.CrossEntropyLoss()
    started = 0.0
    for index, (x, y) in enumerate(private.loader):
        if index == WARMUP:
            if dist.is_initialized():
                dist.barrier()
            started = time.perf_counter()
        private.optimizer.zero_grad()
        loss_fn(private.model(x), y).backward()
        private.optimizer.step()
    if dist.is_initialized():
        dist.barrier()
    seconds = time.perf_counter() - started
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": mode,
        "rank": rank,
        "steps_per_second": args.steps / seconds,
        "peak_rss_added_mb": (rss_after - rss_before) / 1024,
        "state_mb": _state_bytes(private.model, optimizer) / 2**20,
        "ledger_steps": private.ledger.steps,
    }


def _worker(rank: int, mode: str, args: argparse.Namespace, init: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2,
        timeout=datetime.timedelta(minutes=5),
    )  # fmt: skip
    result = _run(mode, args, rank)
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _one(args: argparse.Namespace, out: str) -> None:
    Path(out, "one-0.json").write_text(json.dumps(_run("one", args, 0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for mode in ("one", "ddp", "fsdp"):
            if mode == "one":
                process = mp.get_context("spawn").Process(target=_one, args=(args, out))
                process.start()
                process.join()
            else:
                init = str(Path(out) / f"{mode}-rendezvous")
                mp.spawn(_worker, args=(mode, args, init, out), nprocs=2, join=True)
            for path in sorted(Path(out).glob(f"{mode}-*.json")):
                rows.append(json.loads(path.read_text()))
                print(rows[-1], flush=True)
    result = {
        "settings": vars(args),
        "parameters": sum(p.numel() for p in _model(args.width, args.depth).parameters()),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "torch": torch.__version__,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    existing.append(result)
    RESULTS.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
