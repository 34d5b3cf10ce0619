"""The audit statistics alone: how much ε̂ an audit of a given size can show, and how often a
correct mechanism is bounded above its ε.

Run: ``.venv/bin/python benchmarks/audit_statistics.py``. Writes
``benchmarks/results/audit_statistics.json`` and ``audit_statistics.md``.

* **Ceilings**: the ε̂ of an attack that is never wrong (classical, n trials a side) and of
  guesses that are all right (one-run, m canaries, the declared guess counts), at δ = 10⁻⁵ and
  95 % confidence: no audit of that size can report more, whatever the run leaks.
* **False alarms**: randomised response at exactly ε (an ε-DP mechanism on the boundary of its
  guarantee) audited many times; a sound bound at 95 % exceeds ε in at most ~5 % of audits.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from dpfy.audit.bounds import classical_ceiling, classical_epsilon_lower_bound
from dpfy.audit.one_run import guess_counts, one_run_ceiling, one_run_epsilon_lower_bound

RESULTS = Path(__file__).parent / "results"
DELTA, CONFIDENCE = 1e-5, 0.95
SIZES = (100, 1_000, 10_000, 100_000)


def ceilings() -> list[dict[str, float]]:
    """Classical and one-run ceilings per audit size, with the one-run bound's seconds."""
    rows = []
    for n in SIZES:
        start = time.perf_counter()
        one_run = one_run_ceiling(n, DELTA, CONFIDENCE)
        seconds = time.perf_counter() - start
        rows.append(
            {
                "size": n,
                "classical_ceiling": classical_ceiling(n, n, DELTA, CONFIDENCE),
                "one_run_ceiling": one_run,
                "one_run_guess_counts": list(guess_counts(n)),
                "one_run_seconds": seconds,
            }
        )
    return rows


def false_alarms(epsilon: float, audits: int, trials: int, seed: int) -> dict[str, float]:
    """How often ε̂ > ε for randomised response at exactly ε (pure DP), by each route."""
    rng = np.random.default_rng(seed)
    error = 1.0 / (1.0 + math.exp(epsilon))
    right = rng.binomial(trials, 1.0 - error, size=audits)
    fp, fn = rng.binomial(trials, error, size=audits), rng.binomial(trials, error, size=audits)
    one_run = np.mean(
        [
            one_run_epsilon_lower_bound(trials, int(v), 0.0, CONFIDENCE, trials) > epsilon
            for v in right
        ]
    )
    classical = np.mean(
        [
            classical_epsilon_lower_bound(int(a), trials, int(b), trials, 0.0, CONFIDENCE)
            .epsilon_lower_bound > epsilon
            for a, b in zip(fp, fn, strict=True)
        ]
    )  # fmt: skip
    return {
        "epsilon": epsilon,
        "audits": audits,
        "trials": trials,
        "one_run_exceeds": float(one_run),
        "classical_exceeds": float(classical),
    }


def markdown(data: dict) -> str:
    """The two tables."""
    lines = [
        f"Ceilings at δ = {DELTA:g}, {CONFIDENCE:.0%} confidence (the most ε̂ an audit can show)",
        "",
        "| trials a side / canaries | classical ceiling | one-run ceiling | one-run k "
        "| one-run s |",
        "|---|---|---|---|---|",
    ]
    for row in data["ceilings"]:
        lines.append(
            f"| {row['size']:,} | {row['classical_ceiling']:.3f} | {row['one_run_ceiling']:.3f} "
            f"| {row['one_run_guess_counts']} | {row['one_run_seconds']:.2f} |"
        )
    lines += [
        "",
        "Randomised response at exactly ε, audited repeatedly: share of audits with ε̂ > ε",
        "",
        "| ε | audits | trials | one-run | classical |",
        "|---|---|---|---|---|",
    ]
    for row in data["false_alarms"]:
        lines.append(
            f"| {row['epsilon']:g} | {row['audits']} | {row['trials']} "
            f"| {row['one_run_exceeds']:.3f} | {row['classical_exceeds']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Compute both tables and write them."""
    data = {
        "ceilings": ceilings(),
        "false_alarms": [false_alarms(eps, 500, 1000, seed) for seed, eps in enumerate((1, 2, 4))],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "audit_statistics.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / "audit_statistics.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
