"""Correlated noise against DP-SGD: test accuracy, noise-state memory and step time (issue 30).

Five mechanisms, all through ``dpfy.make_private(..., algorithm=...)``:

=====================  ===========================================================================
``dp-sgd``             Poisson sampling at q = B/N, independent Gaussian noise (add-or-remove)
``dp-ftrl``            DP-FTRL: shuffled batches of B, tree aggregation restarted every epoch
                       (Honaker's estimator), no sampling assumption (zero-out)
``bandmf``             BandMF: one batch order fixed before training and repeated every epoch,
                       default bands min(16, N // B), no sampling assumption (zero-out)
``bandmf-amplified``   BandMF with ``sampler="cyclic-poisson"``: default min(16, ⌊(N // B)/8⌋)
                       fixed groups, each step Poisson-samples the next one (add-or-remove)
``blt``                BLT: the same fixed order as BandMF, default 4 buffers (zero-out)
=====================  ===========================================================================

Each dataset has one set of hyperparameters (below, in ``CONFIGS``), fixed before any run and
the same for every mechanism and ε: the same model and initialisation per seed, optimizer,
learning rate, clip norm, batch size B and number of steps T (DP-SGD's Poisson batches have
expected size B; amplified BandMF's have expected size B as well). Only the noise mechanism and
its sampler change. σ is calibrated by dpfy for each (mechanism, ε) at δ = 1e-5.

For every run the final test accuracy is recorded, with σ, the ε spent, the mean wall time per
step (fetching the batch through ``optimizer.step()``; no evaluation inside) and, on seed 0,
the noise state the mechanism carries: the bytes of the tensors in
``private.optimizer.mechanism.state_dict()``, the largest over all steps (DP-FTRL's tree holds
between 1 and log₂(steps per epoch) + 1 nodes).

Runs are interleaved (dataset → seed → ε → mechanism) so that a change of load on the shared
machine falls on every mechanism alike. Results go to
``benchmarks/results/correlated_noise.json`` and ``.md`` after every run.

    .venv/bin/python benchmarks/correlated_noise.py                  # the full run (~22 min)
    .venv/bin/python benchmarks/correlated_noise.py --smoke          # every path, ~1 min

Seeded runs (``seed=``) are reproducible experiments, and dpfy's report would flag them as such:
anyone who knows the seed can replay the noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dpfy
from dpfy.data.datasets import LoadedDataset, load_dataset
from dpfy.data.loader import rest_of_run
from dpfy.plan.correlated import prefix_sum_error
from dpfy.plan.correlated_events import decode_strategy
from dpfy.train.models import build_model
from dpfy.train.noise.tree import prefix_variance
from fashion_mnist import accuracy, git_state  # the Fashion-MNIST benchmark's own helpers

RESULTS = Path(__file__).parent / "results"
DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = (0, 1, 2)

#: make_private's arguments for each mechanism; everything else is shared.
MECHANISMS: dict[str, dict[str, Any]] = {
    "dp-sgd": {"algorithm": "dp-sgd", "sampler": "poisson"},
    "dp-ftrl": {"algorithm": "dp-ftrl"},
    "bandmf": {"algorithm": "bandmf"},
    "bandmf-amplified": {"algorithm": "bandmf", "sampler": "cyclic-poisson"},
    "blt": {"algorithm": "blt"},
}
LABELS = {
    "dp-sgd": "DP-SGD (Poisson)",
    "dp-ftrl": "DP-FTRL (tree, per-epoch restart)",
    "bandmf": "BandMF (fixed order)",
    "bandmf-amplified": "BandMF, amplified (cyclic Poisson)",
    "blt": "BLT (fixed order, 4 buffers)",
}

#: One configuration per dataset, fixed before running. Optimizer, lr, momentum and C are
#: those of benchmarks/fashion_mnist.py (tuned there for DP-SGD on the full Fashion-MNIST at
#: B = 2048, which favours DP-SGD if anything); B is smaller so that an epoch has enough steps
#: for correlated noise to matter, and Fashion-MNIST uses the first 10 000 training examples so
#: that 45 runs fit the time budget of a shared 2-core machine.
CONFIGS: dict[str, dict[str, Any]] = {
    "digits": {
        "model": "mlp",
        "model_options": {},  # one hidden layer of 128, tanh (dpfy's default MLP)
        "limit": None,
        "batch_size": 64,
        "epochs": 20,
        "lr": 4.0,
        "momentum": 0.9,
        "max_grad_norm": 0.1,
        "why": "On digits, B and the epochs were chosen so that an epoch has tens of steps.",
    },
    "fashion-mnist": {
        "model": "cnn",
        "model_options": {"norm_groups": None, "activation": "tanh", "hidden": 32},
        "limit": 10_000,
        "batch_size": 250,
        "epochs": 10,
        "lr": 4.0,
        "momentum": 0.9,
        "max_grad_norm": 0.1,
        "why": "On fashion-mnist, B and the epochs were chosen for the time budget (45 runs of "
        "the CNN on a shared 2-core machine) and so that an epoch has tens of steps; the data "
        "is cut to its first 10 000 training examples for the same reason, so its accuracies "
        "are far below the full-data 87 % of the paper benchmark.",
    },
    # The whole of Fashion-MNIST (60 000 training images): dpfy's default MLP, so that 45 runs
    # of 600 steps fit a shared 2-core machine; the same optimizer, lr and C as above.
    "fashion-mnist-full": {
        "dataset": "fashion-mnist",
        "model": "mlp",
        "model_options": {},
        "limit": None,
        "batch_size": 1000,
        "epochs": 10,
        "lr": 4.0,
        "momentum": 0.9,
        "max_grad_norm": 0.1,
        "why": "On fashion-mnist-full, all 60 000 training examples with dpfy's default MLP "
        "(45 runs of 600 steps fit the shared machine; the CNN would not): B = 1000 gives an "
        "epoch of 60 steps.",
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: which datasets, ε, seeds and mechanisms; threads; output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--datasets", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument(
        "--mechanisms", nargs="+", default=list(MECHANISMS), choices=list(MECHANISMS)
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument(
        "--smoke", action="store_true", help="1 epoch, 2 000 examples, one seed and ε (paths only)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "correlated_noise.json")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the .md (and summary) from --out"
    )
    return parser.parse_args(argv)


def config_for(dataset: str, smoke: bool) -> dict[str, Any]:
    """The dataset's configuration (shrunk for a smoke run)."""
    config = dict(CONFIGS[dataset])
    if smoke:
        config.update(epochs=1, limit=2000)
    return config


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def run_once(
    data: LoadedDataset, config: dict[str, Any], mechanism: str, epsilon: float, seed: int,
    measure_memory: bool,
) -> dict[str, Any]:  # fmt: skip
    """Train one model with one mechanism at one ε and seed; its accuracy, σ, time and state."""
    torch.manual_seed(seed)  # the same initial model for every mechanism and ε
    model = build_model(
        config["model"], data.input_shape, data.num_classes, **config["model_options"]
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    n, batch = len(data.train), config["batch_size"]
    steps = config["epochs"] * (n // batch)  # full fixed-order epochs; the same T for all
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        private = dpfy.make_private(
            model, optimizer, data.train, batch_size=batch, steps=steps,
            target_epsilon=epsilon, delta=DELTA, max_grad_norm=config["max_grad_norm"],
            seed=seed, **MECHANISMS[mechanism],
        )  # fmt: skip
    planned = time.perf_counter() - started
    plan = private.plan
    criterion = nn.CrossEntropyLoss()
    step_seconds: list[float] = []
    peak_state, batch_sizes = 0, []
    iterator = iter(rest_of_run(private.loader))
    while True:
        t0 = time.perf_counter()
        try:
            x, y = next(iterator)
        except StopIteration:
            break
        private.optimizer.zero_grad()
        criterion(private.model(x), y).backward()
        private.optimizer.step()
        step_seconds.append(time.perf_counter() - t0)
        batch_sizes.append(len(y))
        if measure_memory:
            peak_state = max(peak_state, state_bytes(private.optimizer.mechanism.state_dict()))
    trained = time.perf_counter() - started - planned
    test_accuracy = accuracy(private.model, data.test)
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    timed = step_seconds[5:] or step_seconds  # the first steps warm caches and allocators
    record = {
        "mechanism": mechanism,
        "epsilon_target": epsilon,
        "seed": seed,
        "test_accuracy": test_accuracy,
        "epsilon": private.epsilon(),
        "noise_multiplier": private.noise_multiplier,
        "steps": len(step_seconds),
        "planned_steps": plan.steps,
        "mean_batch_size": statistics.fmean(batch_sizes) if batch_sizes else 0.0,
        "mean_step_seconds": statistics.fmean(timed),
        "median_step_seconds": statistics.median(timed),
        "plan_seconds": planned,
        "train_seconds": trained,
        "relation": plan.relation,
        "sampler": plan.sampler,
        "noise_mechanism": plan.mechanism,
        "strategy": list(plan.strategy) if plan.strategy is not None else None,
        "restart_every": plan.restart_every,
        "tree": plan.tree,
        "sampling_rate": plan.sampling_rate,
        "model_parameters": params,
        "model_parameter_bytes": param_bytes,
        "noise_state_bytes": peak_state if measure_memory else None,
        "load_average": os.getloadavg(),
        "warnings": sorted({str(w.message).split(";")[0][:160] for w in caught}),
    }
    if plan.mechanism == "banded-mf":
        record["bands"] = len(plan.strategy)
    if plan.mechanism == "blt":
        record["buffers"] = len(plan.strategy) // 2
    return record


def running_sum_noise(run: dict[str, Any]) -> float:
    """σ × the RMSE of the noise on the running sum of clipped gradients, over the run's steps
    (in units of C; lower is better): what the plan predicts before any training.

    DP-SGD: σ √((T + 1)/2). BandMF and BLT: σ √(‖A C⁻¹‖_F² / T) from the planned strategy.
    DP-FTRL: each restart leaves its tree's last prefix noise in the sum, so after e whole trees
    and p more steps the variance is σ² (e · v(s) + v(p)), v the tree's prefix variance.
    """
    sigma, steps = run["noise_multiplier"], run["planned_steps"]
    mechanism = run["noise_mechanism"]
    if mechanism == "gaussian":
        return sigma * math.sqrt((steps + 1) / 2)
    if mechanism == "tree-aggregation":
        span, variant = run["restart_every"], run["tree"]
        total = 0.0
        for t in range(1, steps + 1):
            whole, rest = divmod(t, span)
            total += whole * prefix_variance(span, variant)
            total += prefix_variance(rest, variant) if rest else 0.0
        return sigma * math.sqrt(total / steps)
    strategy = decode_strategy(mechanism, tuple(run["strategy"]))
    return sigma * math.sqrt(prefix_sum_error(strategy.inverse_toeplitz(steps), steps) / steps)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per dataset: accuracy mean ± std per (mechanism, ε); memory and step-time ratio per
    mechanism."""
    summary: dict[str, Any] = {}
    for dataset in dict.fromkeys(r["dataset"] for r in runs):
        mine = [r for r in runs if r["dataset"] == dataset]
        accuracy_table: dict[str, dict[str, Any]] = {}
        per_mechanism: dict[str, Any] = {}
        for mechanism in dict.fromkeys(r["mechanism"] for r in mine):
            of = [r for r in mine if r["mechanism"] == mechanism]
            accuracy_table[mechanism] = {}
            for eps in dict.fromkeys(r["epsilon_target"] for r in of):
                cell = [r for r in of if r["epsilon_target"] == eps]
                mean, std = mean_std([r["test_accuracy"] for r in cell])
                accuracy_table[mechanism][f"{eps:g}"] = {
                    "mean": mean,
                    "std": std,
                    "seeds": [r["seed"] for r in cell],
                    "accuracies": [r["test_accuracy"] for r in cell],
                    "noise_multiplier": cell[0]["noise_multiplier"],
                    "running_sum_noise": running_sum_noise(cell[0]),
                    "epsilon_spent": max(r["epsilon"] for r in cell),
                }
            memory = [r["noise_state_bytes"] for r in of if r["noise_state_bytes"] is not None]
            per_mechanism[mechanism] = {
                "noise_state_bytes": max(memory) if memory else None,
                "noise_state_model_copies": (
                    max(memory) / of[0]["model_parameter_bytes"] if memory else None
                ),
                "mean_step_seconds": statistics.fmean(r["mean_step_seconds"] for r in of),
                "median_step_seconds": statistics.median(r["median_step_seconds"] for r in of),
                "runs": len(of),
                "bands": of[0].get("bands"),
                "buffers": of[0].get("buffers"),
                "sampling_rate": of[0]["sampling_rate"],
                "relation": of[0]["relation"],
            }
        base = per_mechanism.get("dp-sgd")
        for entry in per_mechanism.values():
            entry["step_time_ratio_to_dp_sgd"] = (
                entry["mean_step_seconds"] / base["mean_step_seconds"] if base else None
            )
            entry["median_step_time_ratio_to_dp_sgd"] = (
                entry["median_step_seconds"] / base["median_step_seconds"] if base else None
            )
        summary[dataset] = {"accuracy": accuracy_table, "mechanisms": per_mechanism}
    return summary


def markdown(record: dict[str, Any]) -> str:
    """The results page: settings, the accuracy table, memory and step time, the machine."""
    m = record["machine"]
    lines = [
        "# Correlated noise against DP-SGD (issue 30)",
        "",
        f"`{record['command']}` — {record['started']}, {record['status']}, "
        f"{record['wall_seconds'] / 60:.1f} min; {m['cpus']} CPUs, torch threads "
        f"{m['torch_threads']}; load average (1, 5, 15 min) "
        + ", ".join(f"{v:.2f}" for v in m["load_start"])
        + " at the start, "
        + ", ".join(f"{v:.2f}" for v in m.get("load_end") or m["load_start"])
        + f" at the end (1-min load over the runs: {m['load_1min_min']:.2f}–"
        f"{m['load_1min_max']:.2f}); python {m['python']}, torch {m['torch']}, dpfy "
        f"{record['git']['commit']}"
        + (" (src/ modified)" if record["git"]["src_modified"] else "")
        + ".",
        "",
        "## Settings (fixed before running, the same for every mechanism)",
        "",
    ]
    for dataset, c in record["configs"].items():
        n = record["datasets"].get(dataset, {}).get("train_examples")
        lines.append(
            f"- **{dataset}**: `{c['model']}` {c['model_options'] or '(defaults)'}, "
            f"{n} training examples"
            + (f" (the first {c['limit']})" if c["limit"] and c["limit"] < n else "")
            + f", B = {c['batch_size']}, T = {c['steps']} steps ({c['epochs']} epochs of "
            f"{c['steps'] // c['epochs']} fixed-order batches), SGD lr {c['lr']:g} momentum "
            f"{c['momentum']:g}, C = {c['max_grad_norm']:g}, δ = {DELTA:g}; test accuracy "
            "after the last step on the full test split."
        )
    lines += [
        "- Mechanism parameters are dpfy's defaults: BandMF bands = min(16, N // B); amplified "
        "BandMF groups = bands = min(16, ⌊(N // B)/8⌋); BLT 4 buffers; DP-FTRL restarts its "
        "tree every epoch (Honaker estimator, shuffled batches).",
        f"- Seeds {record['seeds']} (model initialisation, sampling and noise).",
        "- Where the settings come from: optimizer, lr, momentum and C are those of "
        "`benchmarks/fashion_mnist.py` (chosen there for DP-SGD on the full Fashion-MNIST at "
        "B = 2048; if they favour anyone it is DP-SGD). "
        + " ".join(CONFIGS[name]["why"] for name in record["configs"] if name in CONFIGS)
        + " Nothing was changed after seeing an accuracy: before this run, only a `--smoke` "
        "run (1 epoch, 2 000 examples, one seed, ε = 1) checked that every path works.",
        "- The ε are not all under the same neighbouring relation: zero-out for the fixed-order "
        "mechanisms, add-or-remove for DP-SGD and amplified BandMF (each mechanism's own, as "
        "dpfy accounts it).",
    ]
    if record["git"]["src_modified"]:
        lines.append(
            "- *src/ modified*: the working tree held uncommitted changes to src/ (other work in "
            "progress on the shared checkout) when the run started; the JSON keeps the sha256 of "
            "that diff (`git.src_diff_sha256`)."
        )
    lines += [
        "",
    ]
    for dataset, summary in record["summary"].items():
        eps_keys = list(dict.fromkeys(k for row in summary["accuracy"].values() for k in row))
        lines += [
            f"## {dataset}: test accuracy (%), mean ± std over seeds; best mean in bold",
            "",
            "In brackets: σ; σ × the RMSE of the noise on the running sum of gradients over the "
            "run, in units of C, from the plan (what theory predicts before training; lower is "
            "better; `running_sum_noise` in the script).",
            "",
            "| mechanism | " + " | ".join(f"ε = {k}" for k in eps_keys) + " |",
            "|---|" + "---|" * len(eps_keys),
        ]
        for mechanism, row in summary["accuracy"].items():
            cells = []
            for k in eps_keys:
                cell = row.get(k)
                best = max(r[k]["mean"] for r in summary["accuracy"].values() if k in r)
                text = (
                    "—" if cell is None else f"{100 * cell['mean']:.1f} ± {100 * cell['std']:.1f}"
                )
                if cell is not None and cell["mean"] == best:
                    text = f"**{text}**"
                cells.append(
                    text
                    if cell is None
                    else f"{text} (σ {cell['noise_multiplier']:.2f}; "
                    f"{cell['running_sum_noise']:.1f})"
                )
            lines.append(f"| {LABELS[mechanism]} | " + " | ".join(cells) + " |")
        lines += [
            "",
            f"## {dataset}: noise state and step time",
            "",
            "| mechanism | strategy | noise state (bytes) | model copies | mean step | ÷ DP-SGD "
            "| median step | ÷ DP-SGD |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for mechanism, e in summary["mechanisms"].items():
            strategy = (
                f"{e['bands']} bands"
                + (f", q = {e['sampling_rate']:.3f}" if mechanism == "bandmf-amplified" else "")
                if e["bands"]
                else f"{e['buffers']} buffers"
                if e["buffers"]
                else "—"
            )
            memory = e["noise_state_bytes"]
            ratio = e["step_time_ratio_to_dp_sgd"]
            median = e["median_step_time_ratio_to_dp_sgd"]
            lines.append(
                f"| {LABELS[mechanism]} | {strategy} | "
                + ("—" if memory is None else f"{memory:,}")
                + " | "
                + ("—" if memory is None else f"{e['noise_state_model_copies']:.0f}")
                + f" | {1000 * e['mean_step_seconds']:.1f} ms | "
                + ("—" if ratio is None else f"{ratio:.2f}×")
                + f" | {1000 * e['median_step_seconds']:.1f} ms | "
                + ("—" if median is None else f"{median:.2f}×")
                + " |"
            )
        lines.append("")
    lines += [
        "Noise state: the tensors in the mechanism's `state_dict()` (what a checkpoint carries and "
        "the run keeps between steps), largest over the steps of the seed-0 runs, float32; "
        "model copies = that ÷ the model's parameter bytes. Step time: wall time from fetching "
        "the batch to the end of `optimizer.step()`, mean over each run's steps after the first "
        "5, averaged over the runs (all ε and seeds); the median column is the median over runs "
        "of each run's median step. The mean includes the budget guard's check at the first "
        "step of every epoch, where BandMF, BLT and DP-FTRL are charged their epoch's increment "
        "(a PLD search, a fixed cost per epoch whatever the model's size); the median leaves it "
        "out and shows the per-step cost of the noise itself. DP-SGD's and amplified BandMF's "
        "batches vary in size around B.",
        "",
        "Seeded runs reproduce exactly; dpfy's report flags a seeded run as not private against "
        "anyone who knows the seed (right for an experiment, wrong for a release).",
        "",
    ]
    return "\n".join(lines)


def write(path: Path, record: dict[str, Any]) -> None:
    """The JSON (atomically) and the Markdown page beside it."""
    record["summary"] = summarise(record["runs"]) if record["runs"] else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    temporary.replace(path)
    if record["runs"]:
        path.with_suffix(".md").write_text(markdown(record))


def main(argv: list[str] | None = None) -> int:
    """Every (dataset, seed, ε, mechanism), interleaved; results written after each run."""
    from dpfy.train.cpu_allocator import keep_freed_memory

    keep_freed_memory()  # as the dpfy command does
    args = parse_args(argv)
    if args.render:
        write(args.out, json.loads(args.out.read_text()))
        return 0
    torch.set_num_threads(args.threads)
    seeds = args.seeds[:1] if args.smoke else args.seeds
    epsilons = args.epsilons[:1] if args.smoke else args.epsilons
    started = time.perf_counter()
    configs = {d: config_for(d, args.smoke) for d in args.datasets}
    record: dict[str, Any] = {
        "benchmark": "correlated_noise",
        "status": "running",
        "command": shlex.join(
            [
                ".venv/bin/python",
                "benchmarks/correlated_noise.py",
                *(sys.argv[1:] if argv is None else argv),
            ]
        ),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "delta": DELTA,
        "epsilons": epsilons,
        "seeds": seeds,
        "mechanisms": {m: MECHANISMS[m] for m in args.mechanisms},
        "configs": {},
        "datasets": {},
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_start": os.getloadavg(),
        },
        "git": git_state(),
        "runs": [],
        "wall_seconds": 0.0,
    }
    total = len(args.datasets) * len(seeds) * len(epsilons) * len(args.mechanisms)
    done = 0
    for dataset in args.datasets:
        config = configs[dataset]
        data = load_dataset(config.get("dataset", dataset), limit=config["limit"])
        n = len(data.train)
        record["configs"][dataset] = {
            **config,
            "steps": config["epochs"] * (n // config["batch_size"]),
        }
        record["datasets"][dataset] = {
            **data.to_dict(),
            "train_examples": n,
            "test_examples": len(data.test),
        }
        for seed in seeds:
            for epsilon in epsilons:
                for mechanism in args.mechanisms:
                    run = run_once(data, config, mechanism, epsilon, seed, seed == seeds[0])
                    run["dataset"] = dataset
                    record["runs"].append(run)
                    done += 1
                    elapsed = time.perf_counter() - started
                    record["wall_seconds"] = elapsed
                    loads = [r["load_average"][0] for r in record["runs"]]
                    record["machine"].update(
                        load_end=os.getloadavg(), load_1min_min=min(loads),
                        load_1min_max=max(loads),
                    )  # fmt: skip
                    write(args.out, record)
                    print(
                        f"[{done}/{total} {elapsed / 60:5.1f} min] {dataset} seed {seed} "
                        f"ε={epsilon:g} {mechanism:16s} acc {run['test_accuracy']:.4f} "
                        f"σ={run['noise_multiplier']:.3f} ε_spent={run['epsilon']:.3f} "
                        f"step {1000 * run['mean_step_seconds']:.1f} ms "
                        f"load {run['load_average'][0]:.2f}",
                        flush=True,
                    )
    record["status"] = "finished"
    record["wall_seconds"] = time.perf_counter() - started
    write(args.out, record)
    print(f"done in {record['wall_seconds'] / 60:.1f} min; results in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
