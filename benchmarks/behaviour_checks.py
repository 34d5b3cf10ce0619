"""What the behaviour checks cost a private step: the probes on their schedule, the state watch.

Run: ``.venv/bin/python benchmarks/behaviour_checks.py [--cases mlp cnn transformer]
[--threads 1 0] [--blocks N]``.

Every private run made by :func:`dpfy.make_private` probes scheduled batches (the default
``CheckSchedule(first=2, every=50)``): the collate path (a few examples collated alone), the
model (re-run once with the other rows replaced) and, with ``criterion=`` and
``private.criterion(...)`` in the loop, the loss (each probed example's loss gradient alone).
On every step the state watch fingerprints every parameter and buffer after the update and
checks the fingerprint before the next one. Each case trains three runs of the same model, data
and seed (so the same batches) in one process, the README's loop with ``private.criterion``:

- ``off``: ``CheckSchedule(first=0, every=None)``, no probe (the state watch still runs);
- ``default``: ``CheckSchedule()``; ``off`` and ``default`` take one step each in every round,
  in alternating order (A/B interleaved, so machine load hits both alike), for ``--warmup``
  rounds and then blocks of 100 rounds: each block holds steps 10 + 100k … 109 + 100k of the
  run, exactly two of them probed (the multiples of 50), so its mean is what the schedule costs
  amortised over a long run;
- ``every``: ``CheckSchedule(first=0, every=1)``, every step probed, one step every
  ``--probe-every`` rounds (interleaved too), for the time of a probed step.

Beside each ``every`` step the ``off`` run times one ``behaviour.state.check()`` +
``.record()`` pair (outside its step: the step times include their own pair), the state watch's
whole cost per step. Reported per case and torch thread count (1 and the default): the mean
step time of ``off`` and ``default`` (median over blocks) and their ratio (median of the blocks'
ratios; target ≤ 1.05), the probed step ÷ the unprobed one (median ``every`` step ÷ median
``off`` step; and each probed step of ``default`` ÷ the ``off`` step of its round, whose batch is
the same), and the state watch pair ÷ the median ``off`` step. Wall and CPU time (all threads of
the process) are both recorded; the machine's load average (``os.getloadavg``) before and after
each case, as the machine is shared. As ``step_overhead.py`` does, ``malloc`` keeps freed memory
for the next step (:func:`dpfy.train.cpu_allocator.keep_freed_memory`) before anything is timed.
Results go to ``benchmarks/results/behaviour_checks.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy import CheckSchedule

#: The three schedules timed side by side (see the module docstring).
SCHEDULES = {
    "off": CheckSchedule(first=0, every=None),
    "default": CheckSchedule(),
    "every": CheckSchedule(first=0, every=1),
}
#: Rounds per block: the default schedule probes exactly two of them (steps 50 and 100 apart).
BLOCK = 100


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 8×8 digits scaled by the public pixel range, and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target)


def digits_mlp() -> tuple[nn.Module, TensorDataset]:
    """The README's model and training set: 64-64-10 on the first 1,400 digits."""
    x, y = digits()
    model = dpfy.fix(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    return model, TensorDataset(x[:1400], y[:1400])


def digits_cnn() -> tuple[nn.Module, TensorDataset]:
    """conv16 → conv32 + GroupNorm(4) → fc64 → 10 on the digits upsampled to 28×28."""
    x, y = digits()
    images = F.interpolate(x.view(-1, 1, 8, 8), size=(28, 28), mode="bilinear")
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip
    return model, TensorDataset(images, y)


class TokenClassifier(nn.Module):
    """Vocabulary 1 000, d_model 64, 2 layers, 4 heads, mean-pooled classifier over 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1_000, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def token_classifier() -> tuple[nn.Module, TensorDataset]:
    """The transformer on 2,048 random sequences of 64 tokens with random labels."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1_000, (2_048, 64), generator=g)
    return TokenClassifier(), TensorDataset(tokens, torch.randint(0, 10, (2_048,), generator=g))


@dataclass(frozen=True)
class Case:
    """A model and its training set, the expected batch size and the blocks timed by default."""

    label: str
    make: Callable[[], tuple[nn.Module, TensorDataset]]
    batch_size: int
    blocks: int


CASES = {
    "mlp": Case("digits MLP 64-64-10 (README), B 128", digits_mlp, 128, 10),
    "cnn": Case("CNN conv16 → conv32+GroupNorm → fc64, 28×28 digits, B 64", digits_cnn, 64, 4),
    "transformer": Case(
        "TransformerEncoder 2×64, 4 heads, T 64, random tokens, B 32", token_classifier, 32, 3
    ),
}


class Run:
    """One private run of the README's loop (with ``private.criterion``), a step at a time."""

    def __init__(
        self, model: nn.Module, data: TensorDataset, case: Case, schedule: CheckSchedule, steps: int
    ) -> None:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        self.private = dpfy.make_private(
            model,
            optimizer,
            data,
            batch_size=case.batch_size,
            steps=steps,
            noise_multiplier=1.0,
            delta=1e-5,
            max_grad_norm=1.0,
            seed=0,  # every schedule draws the same batches
            criterion=nn.CrossEntropyLoss(),
            behaviour_checks=schedule,
        )
        self.schedule = schedule
        self.batches: Iterator[Any] = dpfy.rest_of_run(self.private.loader)
        self.taken = 0

    def step(self) -> tuple[float, float]:
        """Wall and CPU seconds of one whole step: batch, forward, loss, backward, update."""
        private = self.private
        start, start_cpu = time.perf_counter(), time.process_time()
        xb, yb = next(self.batches)
        private.optimizer.zero_grad()
        private.criterion(private.model(xb), yb).backward()
        private.optimizer.step()
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        self.taken += 1
        return wall, cpu

    def probed(self, step: int) -> bool:
        """Whether the run's step numbered ``step`` (0-based) was probed."""
        return self.schedule.due(step)

    def watch_pair(self) -> float:
        """Wall seconds of one state-watch check + record, between two steps (changes nothing)."""
        watch = self.private.optimizer.behaviour.state
        start = time.perf_counter()
        watch.check()
        watch.record()
        return time.perf_counter() - start

    def summary(self) -> dict[str, Any]:
        """What each check did, as the report card would say."""
        return self.private.optimizer.behaviour.summary()


def measure(name: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """Time the three schedules on one case at ``threads`` torch threads (see module docstring)."""
    case = CASES[name]
    torch.set_num_threads(threads)
    blocks = args.blocks or case.blocks
    torch.manual_seed(0)
    model, data = case.make()
    total = args.warmup + blocks * BLOCK + 1
    runs = {key: Run(copy.deepcopy(model), data, case, s, total) for key, s in SCHEDULES.items()}
    off, default, every = runs["off"], runs["default"], runs["every"]
    load_before = os.getloadavg()
    began = time.perf_counter()
    for _ in range(args.warmup):
        for run in runs.values():
            run.step()
    walls: dict[str, list[list[float]]] = {"off": [], "default": []}
    cpus: dict[str, list[list[float]]] = {"off": [], "default": []}
    probed_wall, probed_cpu, pairs, paired = [], [], [], []
    for _ in range(blocks):
        for key in walls:
            walls[key].append([])
            cpus[key].append([])
        for r in range(BLOCK):
            order = ("off", "default") if r % 2 == 0 else ("default", "off")
            for key in order:
                wall, cpu = runs[key].step()
                walls[key][-1].append(wall)
                cpus[key][-1].append(cpu)
            if default.probed(default.taken - 1):  # the same batch as off's step of this round
                paired.append(walls["default"][-1][-1] / walls["off"][-1][-1])
            if r % args.probe_every == 0:
                pairs.append(off.watch_pair())
                wall, cpu = every.step()
                probed_wall.append(wall)
                probed_cpu.append(cpu)
    seconds = time.perf_counter() - began
    load_after = os.getloadavg()
    means = {key: [statistics.fmean(b) for b in blocks_] for key, blocks_ in walls.items()}
    cpu_means = {key: [statistics.fmean(b) for b in blocks_] for key, blocks_ in cpus.items()}
    off_median = statistics.median(w for b in walls["off"] for w in b)
    off_cpu_median = statistics.median(c for b in cpus["off"] for c in b)
    probe_ratio = statistics.median(probed_wall) / off_median
    probed_share = sum(default.probed(s) for s in range(args.warmup, args.warmup + BLOCK)) / BLOCK
    row = {
        "case": name, "label": case.label, "threads": torch.get_num_threads(),
        "blocks": blocks, "steps_per_block": BLOCK, "warmup": args.warmup,
        "off_mean_s": statistics.median(means["off"]),
        "default_mean_s": statistics.median(means["default"]),
        "default_ratio": statistics.median(
            d / o for d, o in zip(means["default"], means["off"], strict=True)
        ),
        "default_ratio_per_block": [
            d / o for d, o in zip(means["default"], means["off"], strict=True)
        ],
        "default_cpu_ratio": statistics.median(
            d / o for d, o in zip(cpu_means["default"], cpu_means["off"], strict=True)
        ),
        "off_median_s": off_median,
        "probed_median_s": statistics.median(probed_wall),
        "probed_ratio": probe_ratio,
        "probed_cpu_ratio": statistics.median(probed_cpu) / off_cpu_median,
        "probed_steps": len(probed_wall),
        "default_probed_over_off_same_batch": paired,
        "expected_default_ratio": 1 + probed_share * (probe_ratio - 1),
        "watch_pair_s": statistics.median(pairs),
        "watch_share": statistics.median(pairs) / off_median,
        "watch_pairs": len(pairs),
        "seconds": seconds, "load_before": load_before, "load_after": load_after,
        "checks": {key: run.summary() for key, run in runs.items()},
    }  # fmt: skip
    for run in runs.values():
        run.private.detach()
    return row


def versions() -> dict[str, str]:
    """The versions the numbers depend on."""
    found = {"python": sys.version.split()[0]}
    for name in ("torch", "scikit-learn", "dpfy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The table of ratios, with the command, the machine's load and what each column means."""
    load = ", ".join(f"{x:.2f}" for x in meta["load_before"])
    load_end = ", ".join(f"{x:.2f}" for x in meta.get("load_after", meta["load_before"]))
    lines = [
        "# Behaviour checks: cost per step",
        "",
        f"`{meta['command']}` — {meta['date']}, {meta['cpus']} CPUs, torch threads "
        f"{' and '.join(str(t) for t in meta['threads'])} (default {meta['default_threads']}); "
        f"load average (1, 5, 15 min) {load} at the start, {load_end} at the end; "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + ".",
        "",
        "Three private runs of each case (same model, data, seed and batches) interleaved in one "
        "process, the README's loop with `criterion=` and `private.criterion`: probes off, the "
        "default schedule (first 2 batches, then every 50th) and every step probed. "
        "*default ÷ off*: mean step over blocks of 100 steps holding 2 probed ones (median over "
        "blocks; target ≤ 1.05); *expected*: 1 + 2 % × (probed ÷ unprobed − 1), the same from "
        "medians, which a loaded machine disturbs less than means. *probed ÷ unprobed*: median "
        "step with every batch probed ÷ median step with none. *state watch*: one `check()` + "
        "`record()` pair, which every step runs (included in all step times), ÷ the median "
        "unprobed step.",
        "",
        "| case | threads | step, probes off | step, default schedule (mean) | default ÷ off | "
        "expected | probed ÷ unprobed | state watch pair | watch ÷ step | load before → after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['label']} | {row['threads']} | {row['off_mean_s'] * 1e3:.2f} ms | "
            f"{row['default_mean_s'] * 1e3:.2f} ms | {row['default_ratio']:.3f}× | "
            f"{row['expected_default_ratio']:.3f}× | {row['probed_ratio']:.2f}× | "
            f"{row['watch_pair_s'] * 1e3:.3f} ms | {row['watch_share'] * 100:.1f} % | "
            f"{row['load_before'][0]:.2f} → {row['load_after'][0]:.2f} |"
        )
    lines += [
        "",
        "## Every measured row",
        "",
        "| case | threads | blocks × steps | default ÷ off per block | CPU time ÷ | probed ÷ "
        "unprobed, CPU | default's probed steps ÷ off, same batch | probed steps | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        blocks = ", ".join(f"{r:.3f}" for r in row["default_ratio_per_block"])
        paired = ", ".join(f"{r:.2f}" for r in row["default_probed_over_off_same_batch"])
        lines.append(
            f"| {row['case']} | {row['threads']} | {row['blocks']} × {row['steps_per_block']} | "
            f"{blocks} | {row['default_cpu_ratio']:.3f}× | {row['probed_cpu_ratio']:.2f}× | "
            f"{paired} | {row['probed_steps']} | {row['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_results(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The JSON of every row and the Markdown table drawn from it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--threads", nargs="+", type=int, default=[1, 0], help="torch threads (0: the default)"
    )
    parser.add_argument("--blocks", type=int, default=0, help="blocks of 100 steps (0: per case)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    parser.add_argument(
        "--probe-every", type=int, default=10, help="rounds per step of the every-batch run"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results") / "behaviour_checks.json"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Time every case at each thread count, print each row, write the JSON and the table."""
    from dpfy.train.cpu_allocator import keep_freed_memory

    keep_freed_memory()  # process-wide, before anything is timed (as step_overhead.py)
    args = parse_args(argv)
    if args.warmup % BLOCK != 10 % BLOCK:
        raise SystemExit("--warmup must be 10 (mod 100): each block then holds 2 probed steps")
    default_threads = torch.get_num_threads()
    threads = [t or default_threads for t in args.threads]
    meta: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([".venv/bin/python", *sys.argv]),
        "cpus": os.cpu_count(), "default_threads": default_threads, "threads": threads,
        "load_before": os.getloadavg(), "versions": versions(),
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    for name in args.cases:  # written after each row: a run cut short keeps what it measured
        for count in threads:
            row = measure(name, count, args)
            rows.append(row)
            print(
                f"{name:12s} threads {row['threads']}: off {row['off_mean_s'] * 1e3:8.2f} ms, "
                f"default ×{row['default_ratio']:.3f} (CPU ×{row['default_cpu_ratio']:.3f}), "
                f"probed ×{row['probed_ratio']:.2f}, watch {row['watch_share'] * 100:.1f} % "
                f"({row['watch_pair_s'] * 1e3:.3f} ms), load {row['load_before'][0]:.2f} → "
                f"{row['load_after'][0]:.2f}, {row['seconds']:.0f} s",
                flush=True,
            )
            meta["load_after"] = os.getloadavg()
            write_results(args.out, meta, rows)
    torch.set_num_threads(default_threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
