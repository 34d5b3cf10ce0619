"""Accounting benchmark: dpfy PLD vs dp_accounting PLD vs prv_accountant, in one run.

Prints, per setting, each accountant's ε and wall time, then calibration times (σ for a target
ε). Writes `benchmarks/results/accounting.json` and `.md`, which the README quotes.

    .venv/bin/python benchmarks/accounting.py            # full run (several minutes)
    .venv/bin/python benchmarks/accounting.py --quick    # three settings
    .venv/bin/python benchmarks/accounting.py --heterogeneous [--with-exact]
        # 10⁴ distinct steps (σ or q schedules) and the budget guard (accounting_schedules.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import dp_accounting as dpa
from dp_accounting import pld as dpa_pld
from prv_accountant.dpsgd import DPSGDAccountant
from scipy.optimize import brentq

from dpfy.plan.accounting import PldAccountant, calibrate_noise_multiplier, dpsgd_event

RESULTS = Path(__file__).parent / "results"

# (q, σ, steps, δ)
SETTINGS = [
    (0.005, 1.0, 200, 1e-6),
    (0.0064, 1.0, 782, 1e-6),
    (1e-4, 0.6, 100_000, 1e-5),
    (1e-3, 0.8, 100_000, 1e-6),
    (0.01, 1.0, 10_000, 1e-5),
    (0.01, 3.0, 100_000, 1e-6),
    (0.1, 0.6, 10, 1e-5),
    (0.1, 2.0, 1_000, 1e-7),
    (1e-4, 1.0, 1_000_000, 1e-6),
    (1e-3, 2.0, 1_000_000, 1e-6),
]
# (q, steps, target ε, δ)
CALIBRATIONS = [
    (0.005, 200, 0.5868, 1e-6),
    (256 / 60_000, 2344, 3.0, 1e-5),
    (1e-3, 100_000, 1.0, 1e-6),
    (0.01, 10_000, 8.0, 1e-5),
]


def timed(fn: Callable[[], float], repeats: int = 3) -> tuple[float, float]:
    """(value, median seconds) over a few repeats."""
    times, value = [], float("nan")
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return value, statistics.median(times)


def dpfy_eps(q: float, sigma: float, steps: int, delta: float) -> float:
    return PldAccountant().compose(dpsgd_event(q, sigma, steps)).epsilon(delta)


def dpa_eps(q: float, sigma: float, steps: int, delta: float) -> float:
    accountant = dpa_pld.PLDAccountant()
    accountant.compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    )
    return accountant.get_epsilon(delta)


def prv_eps(q: float, sigma: float, steps: int, delta: float) -> float:
    accountant = DPSGDAccountant(
        noise_multiplier=sigma, sampling_probability=q, eps_error=0.01,
        delta_error=delta / 1000, max_steps=steps,
    )  # fmt: skip
    return accountant.compute_epsilon(delta=delta, num_steps=steps)[2]  # the upper bound


def dpa_calibrate(q: float, steps: int, target: float, delta: float) -> float:
    return dpa.calibrate_dp_mechanism(
        dpa_pld.PLDAccountant,
        lambda s: dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), steps
        ),
        target,
        delta,
    )


def prv_calibrate(q: float, steps: int, target: float, delta: float) -> float:
    """σ from prv_accountant's upper bound by root finding (as Opacus's PRV calibration does).

    NaN when prv_accountant fails inside the bracket (it refuses some very small σ).
    """
    try:
        return brentq(lambda s: prv_eps(q, s, steps, delta) - target, 0.5, 10.0, xtol=1e-3)
    except (RuntimeError, ValueError, MemoryError):
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three settings, one calibration")
    parser.add_argument(
        "--heterogeneous", action="store_true", help="10⁴ distinct steps and the budget guard"
    )
    parser.add_argument(
        "--with-exact", action="store_true", help="also PLD without rounding (minutes per case)"
    )
    args = parser.parse_args()
    if args.heterogeneous:
        from accounting_schedules import render_markdown as render_schedules
        from accounting_schedules import run as run_schedules

        results = run_schedules(with_exact=args.with_exact)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "accounting-heterogeneous.json").write_text(json.dumps(results, indent=2))
        (RESULTS / "accounting-heterogeneous.md").write_text(render_schedules(results))
        print(f"wrote {RESULTS / 'accounting-heterogeneous'}.json and .md")
        return
    settings = SETTINGS[:3] if args.quick else SETTINGS
    calibrations = CALIBRATIONS[:1] if args.quick else CALIBRATIONS
    rows = []
    print(f"{'q':>8} {'σ':>5} {'steps':>9} {'δ':>6} | {'dpfy ε':>8} {'ms':>6} | "
          f"{'dp_acc ε':>8} {'ms':>6} | {'prv ε':>8} {'ms':>6}")  # fmt: skip
    for q, sigma, steps, delta in settings:
        ours, t_ours = timed(partial(dpfy_eps, q, sigma, steps, delta))
        theirs, t_theirs = timed(partial(dpa_eps, q, sigma, steps, delta), repeats=1)
        try:
            prv, t_prv = timed(partial(prv_eps, q, sigma, steps, delta), repeats=1)
        except (MemoryError, ValueError, RuntimeError):
            prv, t_prv = float("nan"), float("nan")
        rows.append({
            "q": q, "sigma": sigma, "steps": steps, "delta": delta,
            "dpfy_epsilon": ours, "dpfy_seconds": t_ours,
            "dp_accounting_epsilon": theirs, "dp_accounting_seconds": t_theirs,
            "prv_upper_epsilon": prv, "prv_seconds": t_prv,
        })  # fmt: skip
        print(f"{q:8.1e} {sigma:5.2f} {steps:9d} {delta:6.0e} | {ours:8.4f} {t_ours*1e3:6.1f} | "
              f"{theirs:8.4f} {t_theirs*1e3:6.0f} | {prv:8.4f} {t_prv*1e3:6.0f}")  # fmt: skip
    cal_rows = []
    print(f"\n{'q':>8} {'steps':>7} {'ε':>6} | {'dpfy σ':>8} {'s':>6} | {'dp_acc σ':>8} {'s':>6} | "
          f"{'prv σ':>8} {'s':>6}")  # fmt: skip
    for q, steps, target, delta in calibrations:
        ours, t_ours = timed(partial(calibrate_noise_multiplier, target, delta, q, steps))
        theirs, t_theirs = timed(partial(dpa_calibrate, q, steps, target, delta), repeats=1)
        prv, t_prv = timed(partial(prv_calibrate, q, steps, target, delta), repeats=1)
        cal_rows.append({
            "q": q, "steps": steps, "target_epsilon": target, "delta": delta,
            "dpfy_sigma": ours, "dpfy_seconds": t_ours,
            "dp_accounting_sigma": theirs, "dp_accounting_seconds": t_theirs,
            "prv_sigma": prv, "prv_seconds": t_prv,
        })  # fmt: skip
        print(f"{q:8.1e} {steps:7d} {target:6.3g} | {ours:8.4f} {t_ours:6.2f} | "
              f"{theirs:8.4f} {t_theirs:6.2f} | {prv:8.4f} {t_prv:6.2f}")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    name = "accounting-quick" if args.quick else "accounting"
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"epsilon": rows, "calibration": cal_rows}, indent=2)
    )
    (RESULTS / f"{name}.md").write_text(render_markdown(rows, cal_rows))
    print(f"\nwrote {RESULTS / name}.json and .md")


def render_markdown(rows: list[dict], cal_rows: list[dict]) -> str:
    """The tables the README quotes."""
    lines = [
        "| q | σ | steps | δ | dpfy ε | dpfy ms | dp_accounting ε | dp_accounting ms "
        "| PRV upper ε | PRV ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['q']:.1e} | {r['sigma']:g} | {r['steps']:,} | {r['delta']:.0e} "
            f"| {r['dpfy_epsilon']:.4f} | {r['dpfy_seconds'] * 1e3:.0f} "
            f"| {r['dp_accounting_epsilon']:.4f} | {r['dp_accounting_seconds'] * 1e3:.0f} "
            f"| {r['prv_upper_epsilon']:.4f} | {r['prv_seconds'] * 1e3:.0f} |"
        )
    lines += [
        "",
        "| q | steps | target ε | δ | dpfy σ | dpfy s | dp_accounting σ | dp_accounting s "
        "| PRV σ | PRV s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cal_rows:
        lines.append(
            f"| {r['q']:.2e} | {r['steps']:,} | {r['target_epsilon']:g} | {r['delta']:.0e} "
            f"| {r['dpfy_sigma']:.4f} | {r['dpfy_seconds']:.2f} "
            f"| {r['dp_accounting_sigma']:.4f} | {r['dp_accounting_seconds']:.2f} "
            f"| {r['prv_sigma']:.4f} | {r['prv_seconds']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
