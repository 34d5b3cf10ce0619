"""DP fine-tuning accuracy: MiniLM on Rotten Tomatoes at ε = 3 and ε = 8 beside non-private.

Issue 18's target: at ε = 8 within 3 points of the non-private baseline with the same schedule,
at ε = 3 within 6. The script prepares the public weights and the data once (for ``head`` and
``last-N`` the frozen lower layers' output is cached: computed from the public weights and the
private text, with DP-SGD on the trainable part covering it), then trains the same schedule
without privacy and with DP-SGD at each ε (σ calibrated by the PLD accountant, Poisson
sampling, δ = 1e-6 < 1/N), each from the same public starting point, and evaluates on the
2,000-example test split. Every run is appended to ``benchmarks/results/finetune_<mode>.json``
with its command, settings, seconds and accuracy, so every run tried is on record.

The hyperparameters are fixed a priori (see docs/finetuning.md), not tuned on this data: a
choice made by looking at these test accuracies would itself be tuning on held-out data.

    .venv/bin/python benchmarks/finetune.py                       # head, 20 epochs, B 1024
    .venv/bin/python benchmarks/finetune.py --mode last-1         # top layer + head, same schedule

The other table of issue 18, step time and peak memory of fine-tuning (MiniLM full / last-2 /
LoRA, ResNet-18-GN, GPT-2 small) against non-private and Opacus, is
``benchmarks/finetune_speed.py``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from dpfy.jobs.finetune import make_private_run, train_non_private, train_private
from dpfy.jobs.finetune_config import FinetuneConfig
from dpfy.jobs.finetune_setup import prepare
from dpfy.train.cpu_allocator import keep_freed_memory

RESULTS = Path(__file__).parent / "results"
TARGET_GAP = {8.0: 0.03, 3.0: 0.06}  # issue 18: points below non-private allowed at each ε
PRIOR = (
    "fixed a priori, not tuned on this data: large batches and several epochs (Li et al. 2022; "
    "Yu et al. 2022: DP fine-tuning wants B ≈ 1000 and more steps), AdamW at its usual 1e-3, "
    "C = 1 (every per-example gradient is clipped, the regime Li et al. recommend)"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Mode, schedule, the ε values and the seed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mode", default="head", help="head, last-N, lora or full")
    parser.add_argument("--epochs", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0])
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one set of runs per seed (spread)"
    )
    parser.add_argument("--limit", type=int, default=None, help="examples per split (smoke)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    return parser.parse_args(argv)


def _record(path: Path, entry: dict[str, Any]) -> None:
    """Append one run to the results file (every run is kept)."""
    doc = json.loads(path.read_text()) if path.exists() else {"runs": []}
    doc["runs"].append(entry)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _runs(
    prepared: Any,
    config: FinetuneConfig,
    epsilons: list[float],
    out: Path,
    common: dict[str, Any],
    console: Console,
) -> None:
    """The non-private baseline and one DP run per ε at ``config.seed``, each recorded."""
    common = {**common, "seed": config.seed}
    t0 = time.perf_counter()
    baseline = train_non_private(prepared, config, console)
    seconds = time.perf_counter() - t0
    print(f"seed {config.seed} non-private: {baseline:.4f} ({seconds:.0f} s)")
    _record(out, {**common, "run": "non-private", "test_accuracy": baseline,
                  "seconds": round(seconds, 1)})  # fmt: skip
    for eps in epsilons:
        run_config = replace(config, target_epsilon=eps)
        t0 = time.perf_counter()
        private = make_private_run(prepared, run_config)
        history = train_private(private, prepared.test, console)
        private.detach()
        seconds = time.perf_counter() - t0
        accuracy = history[-1]["test_accuracy"]
        gap = baseline - accuracy
        allowed = TARGET_GAP.get(eps)
        shown = "—" if allowed is None else f"{100 * allowed:g}"
        print(f"seed {config.seed} ε = {eps:g}: {accuracy:.4f} (gap {100 * gap:.2f} points; "
              f"allowed {shown}) ({seconds:.0f} s)")  # fmt: skip
        _record(out, {**common, "run": f"dp eps={eps:g}", "target_epsilon": eps,
                      "epsilon": private.epsilon(), "delta": private.plan.delta,
                      "noise_multiplier": private.noise_multiplier,
                      "steps": private.plan.steps, "test_accuracy": accuracy,
                      "non_private_accuracy": baseline, "gap_points": round(100 * gap, 2),
                      "target_met": None if allowed is None else gap <= allowed,
                      "history": history, "seconds": round(seconds, 1)})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Prepare once, run non-private and every ε, print and record each run."""
    args = parse_args(argv)
    keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = FinetuneConfig(mode=args.mode, epochs=args.epochs, batch_size=args.batch_size,
                            lr=args.lr, max_grad_norm=args.max_grad_norm, seed=args.seeds[0],
                            limit=args.limit, delta=1e-6)  # fmt: skip
    command = shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv])
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"finetune_{args.mode}.json"
    console = Console()
    started = time.perf_counter()
    prepared = prepare(config)
    prepare_seconds = time.perf_counter() - started
    print(f"prepared ({args.mode}; {len(prepared.train)} train / {len(prepared.test)} test) "
          f"in {prepare_seconds:.0f} s")  # fmt: skip
    common = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "hyperparameters": PRIOR,
        "train_size": len(prepared.train),
        "test_size": len(prepared.test),
        "prepare_seconds": round(prepare_seconds, 1),
        "threads": torch.get_num_threads(),
    }
    for seed in args.seeds:
        _runs(prepared, replace(config, seed=seed), args.epsilons, out, common, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
