"""Accuracy of the guide's access models side by side (§3.2): label-only, full-training, prediction.

For each dataset and ε ∈ {1, 2, 4, 8}, with the same model, optimizer, epochs and batch size
(fixed a priori from ``dpfy train``'s defaults, not tuned on the test split):

- label-only DP, k-ary randomised response (``rr``) and RR-with-prior in 2 stages (``rr-prior``,
  Ghazi et al. 2021), features treated as public — ε per label, δ = 0; trained with the
  forward-corrected loss (the default of :func:`dpfy.access.label_dp.train_label_private`);
- full-training DP-SGD through the ``dpfy train`` job's own set-up (σ calibrated by PLD for the
  target ε at δ = 10^-(⌈log10 N⌉+1), Poisson sampling, C = 1) — ε for features and labels;
- input-level DP: each record randomised locally (Laplace on features clipped into public bounds,
  RR on the label, ε/2 each; :class:`dpfy.access.input_dp.InputRandomiser`) — ε per record;
- prediction-level DP from ``benchmarks/_prediction_level.py`` when that module is present
  (accuracy of the answered queries and how many were answered), else a row saying "not run";
- a non-private baseline (same model and schedule) for reference.

The comparison is only meaningful where the features are public: label DP protects nothing else.
Fashion-MNIST uses its first ``--fashion-limit`` training and test images (default 5 000) to
keep the default run near 10 minutes on two CPU cores; every row records the sizes it used.
Results go to ``benchmarks/results/access_models.json`` and ``.md``.

    .venv/bin/python benchmarks/access_models.py
    .venv/bin/python benchmarks/access_models.py --datasets digits --epsilons 1 8   # quick
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from dpfy.access.feature_bounds import bounds_for
from dpfy.access.input_dp import InputRandomiser
from dpfy.access.label_dp import fit_on_labels, train_label_private
from dpfy.data.datasets import LoadedDataset, load_dataset
from dpfy.jobs.config import TrainConfig
from dpfy.jobs.loop import accuracy, train_private
from dpfy.jobs.train import _make_run, fresh_model, train_baseline

RESULTS = Path(__file__).resolve().parent / "results"
EPSILONS = (1.0, 2.0, 4.0, 8.0)
#: Per dataset: the run's settings (dpfy train's defaults; Fashion-MNIST a larger batch).
SETTINGS = {
    "digits": TrainConfig(dataset="digits", model="mlp", epochs=20, batch_size=128, lr=0.01),
    "fashion-mnist": TrainConfig(
        dataset="fashion-mnist", model="mlp", epochs=10, batch_size=256, lr=0.01
    ),
}


def _load(name: str, fashion_limit: int) -> LoadedDataset:
    """The dataset as ``dpfy train`` loads it (Fashion-MNIST cut to its first images)."""
    return load_dataset(name, limit=fashion_limit if name == "fashion-mnist" else None)


def _label_row(config: TrainConfig, data: LoadedDataset, mechanism: str, eps: float) -> dict:
    """Label-only DP at ε per label: randomise once, train without noise, test accuracy."""
    started = time.perf_counter()
    features, labels = data.train.tensors
    result = train_label_private(
        lambda: fresh_model(config, data), features, labels, data.num_classes, eps,
        mechanism=mechanism, stages=2 if mechanism == "rr-prior" else 1,
        epochs=round(config.epochs), batch_size=config.batch_size, seed=config.seed,
    )  # fmt: skip
    return {
        "access": "label", "mechanism": mechanism, "epsilon": result.ledger.epsilon, "delta": 0.0,
        "accuracy": accuracy(result.model, data.test), "seconds": time.perf_counter() - started,
    }  # fmt: skip


def _dpsgd_row(config: TrainConfig, data: LoadedDataset, eps: float) -> dict:
    """Full-training DP-SGD with the ``dpfy train`` job's set-up and loop."""
    started = time.perf_counter()
    run_config = replace(config, target_epsilon=eps)
    private, _ = _make_run(run_config, data)
    train_private(private, data, Console(quiet=True), eval_every=private.plan.steps)
    return {
        "access": "full", "mechanism": "dp-sgd", "epsilon": eps, "epsilon_spent": private.epsilon(),
        "delta": private.plan.delta, "accuracy": accuracy(private.model, data.test),
        "seconds": time.perf_counter() - started, "noise_multiplier": private.plan.noise_multiplier,
        "steps": private.plan.steps,
    }  # fmt: skip


def _input_row(config: TrainConfig, name: str, fashion_limit: int, eps: float) -> dict:
    """Input-level DP at ε per record: randomise each record, train without noise."""
    started = time.perf_counter()
    standardize = bounds_for(name, 1)[1]
    limit = fashion_limit if name == "fashion-mnist" else None
    data = load_dataset(name, limit=limit, standardize=standardize)
    features, labels = data.train.tensors
    bounds, _ = bounds_for(name, features[0].numel())
    randomiser = InputRandomiser(bounds, eps, label_share=0.5)
    out = randomiser(
        features.numpy(), labels.numpy(), data.num_classes, np.random.default_rng(config.seed)
    )
    model = fit_on_labels(
        lambda: fresh_model(config, data), torch.from_numpy(out.features.astype(np.float32)),
        torch.from_numpy(np.asarray(out.labels, dtype=np.int64)), epochs=round(config.epochs),
        batch_size=config.batch_size, seed=config.seed or 0,
    )  # fmt: skip
    return {
        "access": "input", "mechanism": "laplace+rr", "epsilon": eps, "delta": 0.0,
        "accuracy": accuracy(model, data.test), "laplace_scale": randomiser.noise_scale,
        "seconds": time.perf_counter() - started,
    }  # fmt: skip


def _prediction_rows(name: str, epsilons: tuple[float, ...], seed: int) -> list[dict]:
    """Prediction-level DP rows from part 2's module, or one row saying it did not run."""
    try:
        module = importlib.import_module("_prediction_level")
    except ImportError:
        return [{"access": "prediction", "mechanism": "PATE", "note": "not run: "
                 "benchmarks/_prediction_level.py is not present"}]  # fmt: skip
    rows = module.run(name, epsilons, seed)
    return [{"access": "prediction", **row} for row in rows]


def _dataset_rows(name: str, args: argparse.Namespace) -> list[dict]:
    """Every method at every ε on one dataset, plus the non-private baseline."""
    config = replace(SETTINGS[name], seed=args.seed)
    data = _load(name, args.fashion_limit)
    started = time.perf_counter()
    baseline = train_baseline(config, data)
    rows = [
        {"access": "none", "mechanism": "non-private", "epsilon": None, "accuracy": baseline,
         "seconds": time.perf_counter() - started}
    ]  # fmt: skip
    for eps in args.epsilons:
        rows.append(_label_row(config, data, "rr", eps))
        rows.append(_label_row(config, data, "rr-prior", eps))
        rows.append(_dpsgd_row(config, data, eps))
        rows.append(_input_row(config, name, args.fashion_limit, eps))
        print(f"{name} ε={eps:g}: " + ", ".join(
            f"{r['mechanism']} {r['accuracy']:.4f}" for r in rows[-4:]), flush=True)  # fmt: skip
    for row in rows:
        row.update(dataset=name, train_size=len(data.train), test_size=len(data.test))
    # prediction-level rows come from their own module, on the whole training split
    return rows + [
        {"dataset": name, **row} for row in _prediction_rows(name, tuple(args.epsilons), args.seed)
    ]


def _cell(row: dict | None) -> str:
    """An accuracy cell (with the answered count for prediction-level rows)."""
    if row is None:
        return "—"
    if row.get("accuracy") is None:
        return row.get("note", "not run")
    text = f"{100 * row['accuracy']:.2f} %"
    if row.get("queries_answered") is not None:
        text += f" ({row['queries_answered']} of {row.get('queries_offered', '?')} answered)"
    return text


def _markdown(document: dict) -> str:
    """One table per dataset: methods as columns, ε as rows."""
    lines = ["# Access models: accuracy at the same ε (guide §3.2)", "",
             f"Command: `{document['command']}`  ", f"Date: {document['date']}", ""]  # fmt: skip
    methods = [
        ("label", "rr"), ("label", "rr-prior"), ("full", "dp-sgd"), ("input", "laplace+rr"),
        ("prediction", None),
    ]  # fmt: skip
    for name in document["datasets"]:
        rows = [r for r in document["rows"] if r["dataset"] == name]
        base = next(r for r in rows if r["access"] == "none")
        predicted = next(
            (r for r in rows if r["access"] == "prediction" and "train_size" in r), None
        )
        lines += [f"## {name} (train {base['train_size']}, test {base['test_size']}; non-private "
                  f"{100 * base['accuracy']:.2f} %)", "",
                  "| ε | label DP: RR | label DP: RR-with-prior (2 stages) | full DP-SGD | "
                  "input-level (local) | prediction-level |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for eps in document["epsilons"]:
            cells = []
            for access, mechanism in methods:
                match = [r for r in rows if r["access"] == access
                         and (mechanism is None or r.get("mechanism") == mechanism)
                         and (r.get("epsilon") == eps or "note" in r)]  # fmt: skip
                cells.append(_cell(match[0] if match else None))
            lines.append(f"| {eps:g} | " + " | ".join(cells) + " |")
        if predicted is not None and predicted["train_size"] != base["train_size"]:
            size = predicted["train_size"]
            lines.append("")
            lines.append(f"Prediction-level: teachers on {size} records (the whole training "
                         "split, as its module trains them), not the subset above.")  # fmt: skip
        lines.append("")
    lines.append(document["note"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fashion-limit", type=int, default=5_000)
    parser.add_argument("--out", type=Path, default=RESULTS / "access_models.json")
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    started = time.perf_counter()
    rows = [row for name in args.datasets for row in _dataset_rows(name, args)]
    document = {
        "benchmark": "access_models",
        "command": " ".join([".venv/bin/python benchmarks/access_models.py", *given]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "datasets": args.datasets, "epsilons": args.epsilons, "seed": args.seed,
        "seconds": time.perf_counter() - started, "rows": rows,
        "note": ("Label DP: ε per label, δ = 0, features treated as public (it protects nothing "
                 "else). Full DP-SGD: ε for features and labels at the δ in the JSON. Input-level: "
                 "ε per record (local DP, δ = 0). Prediction-level: accuracy of the answered test "
                 "queries and how many were answered before the budget ran out. "
                 "Hyperparameters fixed a priori (dpfy train's defaults), one seed; the seed "
                 "fixes the randomisation (an experiment, not a private release)."),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(_markdown(document), encoding="utf-8")
    print(_markdown(document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
