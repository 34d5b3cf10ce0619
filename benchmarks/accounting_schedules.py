"""Heterogeneous accounting cases: 10⁴ distinct DP-SGD steps (σ or q changing every step).

Run through ``benchmarks/accounting.py --heterogeneous`` (writes accounting-heterogeneous.json
and .md). Per schedule: ε and seconds of dpfy's PLD and RDP accountants from a cold start
(composing every step, then one ε query; median of 3 fresh accountants), and, with
``--with-exact``, PLD without rounding (every step its own FFT: minutes) to show what rounding
many steps up costs; dp_accounting
on the first ``DPA_STEPS`` steps (its cost grows linearly with distinct steps), dpfy on the
same prefix; then the budget guard, stepping a σ schedule up to a target, in ms per step;
and the process's peak resident memory.
"""

from __future__ import annotations

import logging
import resource
import statistics
import time
from collections.abc import Callable
from functools import partial

import dp_accounting as dpa
import numpy as np
from dp_accounting import pld as dpa_pld
from dp_accounting import rdp as dpa_rdp

from dpfy.plan.accounting import (
    GaussianEvent,
    PldAccountant,
    PldPrecision,
    PoissonSampledEvent,
    make_accountant,
)
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.ledger import BudgetExhausted, PrivacyLedger
from dpfy.train.step_record import StepRecord

STEPS = 10_000
DPA_STEPS = 1_000
DELTA = 1e-5
DATASET = 60_000
logging.getLogger("absl").setLevel(logging.ERROR)  # dp_accounting's series warnings


def schedules(steps: int = STEPS) -> dict[str, list[tuple[float, float]]]:
    """(q, σ) per step: a linear σ schedule at B = 256 of 60 000, a q schedule, both at once."""
    sigma = np.linspace(1.6, 0.8, steps).tolist()
    rate = np.linspace(0.002, 0.01, steps).tolist()
    fixed_q, fixed_sigma = [256 / DATASET] * steps, [1.0] * steps
    return {
        "σ 1.6→0.8, q=256/60000": list(zip(fixed_q, sigma, strict=True)),
        "q 0.002→0.01, σ=1": list(zip(rate, fixed_sigma, strict=True)),
        "q 0.002→0.01 and σ 1.6→0.8": list(zip(rate, sigma, strict=True)),
    }


def timed(fn: Callable[[], float], repeats: int = 1) -> tuple[float, float]:
    """(value, median seconds) of ``repeats`` cold calls (each builds its own accountant)."""
    times, value = [], float("nan")
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return value, statistics.median(times)


def dpfy_epsilon(name: str, steps: list[tuple[float, float]], precision=None) -> float:
    """Compose every step into a fresh accountant, then one ε query."""
    accountant = PldAccountant(precision=precision) if precision else make_accountant(name)
    for q, sigma in steps:
        accountant.compose(PoissonSampledEvent(q, GaussianEvent(sigma)))
    return accountant.epsilon(DELTA)


def dpa_epsilon(name: str, steps: list[tuple[float, float]]) -> float:
    """The same with dp_accounting (PLD at its 1e-3 loss interval: 1e-4 takes far longer)."""
    accountant = (
        dpa_pld.PLDAccountant(value_discretization_interval=1e-3)
        if name == "pld"
        else dpa_rdp.RdpAccountant()
    )
    for q, sigma in steps:
        accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)))
    return accountant.get_epsilon(DELTA)


def guard(name: str, steps: list[tuple[float, float]], fraction: float = 0.95) -> dict:
    """check_step + record over the schedule, target = fraction × ε of the whole schedule."""
    records = [
        StepRecord(SamplingRecord(SamplingKind.POISSON, q, DATASET), sigma) for q, sigma in steps
    ]
    target = fraction * dpfy_epsilon(name, steps)
    ledger = PrivacyLedger(DELTA, accountant=name, target_epsilon=target)
    start, refused = time.perf_counter(), None
    for i, record in enumerate(records):
        try:
            ledger.check_step(record)
        except BudgetExhausted:
            refused = i
            break
        ledger.record(record)
    seconds = time.perf_counter() - start
    walked = refused if refused is not None else len(records)
    return {
        "accountant": name, "target_epsilon": target, "refused_at": refused,
        "spent_epsilon": ledger.epsilon(), "seconds": seconds,
        "ms_per_step": 1e3 * seconds / max(walked, 1),
    }  # fmt: skip


def run(with_exact: bool = False) -> dict:
    """Every case, printed as it goes."""
    rows = []
    for label, steps in schedules().items():
        row: dict = {"schedule": label, "steps": len(steps), "dpa_steps": DPA_STEPS}
        prefix = steps[:DPA_STEPS]
        for name in ("pld", "rdp"):
            row[f"{name}_epsilon"], row[f"{name}_seconds"] = timed(
                partial(dpfy_epsilon, name, steps), repeats=3
            )
            row[f"{name}_prefix_epsilon"], _ = timed(partial(dpfy_epsilon, name, prefix))
            row[f"dpa_{name}_prefix_epsilon"], row[f"dpa_{name}_prefix_seconds"] = timed(
                partial(dpa_epsilon, name, prefix)
            )
        if with_exact:
            exact = PldPrecision(rounding_resolution=1e-12)  # rounds nothing away
            row["pld_exact_epsilon"], row["pld_exact_seconds"] = timed(
                partial(dpfy_epsilon, "pld", steps, exact)
            )
        rows.append(row)
        print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
    first = next(iter(schedules().values()))
    guards = [guard(name, first) for name in ("rdp", "pld")]
    for g in guards:
        print(g)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"epsilon": rows, "guard": guards, "peak_rss_mb": peak, "delta": DELTA}


def render_markdown(results: dict) -> str:
    """The tables docs/performance.md and the README quote."""
    lines = [
        f"10⁴ distinct steps, δ = {results['delta']:g}; seconds per cold ε query (compose every "
        "step into a fresh accountant, then ε; dpfy: median of 3).",
        "",
        "| schedule | PLD ε | PLD s | PLD ε, no rounding | RDP ε | RDP s "
        f"| first {DPA_STEPS}: dpfy PLD / dp_accounting PLD ε, s "
        f"| first {DPA_STEPS}: dpfy RDP / dp_accounting RDP ε, s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["epsilon"]:
        exact = (
            f"{r['pld_exact_epsilon']:.4f} ({r['pld_exact_seconds']:.0f} s)"
            if "pld_exact_epsilon" in r
            else "—"
        )
        lines.append(
            f"| {r['schedule']} | {r['pld_epsilon']:.4f} | {r['pld_seconds']:.2f} | {exact} "
            f"| {r['rdp_epsilon']:.4f} | {r['rdp_seconds']:.2f} "
            f"| {r['pld_prefix_epsilon']:.4f} / {r['dpa_pld_prefix_epsilon']:.4f}, "
            f"{r['dpa_pld_prefix_seconds']:.0f} "
            f"| {r['rdp_prefix_epsilon']:.4f} / {r['dpa_rdp_prefix_epsilon']:.4f}, "
            f"{r['dpa_rdp_prefix_seconds']:.0f} |"
        )
    lines += [
        "",
        "| budget guard (σ schedule) | target ε | refused at step | ε spent | ms per step |",
        "|---|---|---|---|---|",
    ]
    for g in results["guard"]:
        lines.append(
            f"| {g['accountant']} | {g['target_epsilon']:.4f} | {g['refused_at']} "
            f"| {g['spent_epsilon']:.4f} | {g['ms_per_step']:.2f} |"
        )
    lines += ["", f"Peak resident memory of the whole run: {results['peak_rss_mb']:.0f} MB."]
    return "\n".join(lines) + "\n"
