"""The least a CPU step can cost with Gaussian noise on every parameter, whatever the engine does.

Run: ``.venv/bin/python benchmarks/noise_floor.py [--model mlp] [--threads 1 2]``.

DP-SGD adds N(0, σ²C²) to every coordinate of every step. On a CPU, torch draws it with one
generator per device (Mersenne Twister, then Box–Muller), serially: a draw runs on one core. For
each torch thread count this measures, in one process:

* ``step``: the median non-private SGD step of a ``step_overhead.py`` model;
* ``draw``: the median time to draw one step's noise (one value per parameter) on this thread;
* ``split``: the same values drawn as two halves from two generators, one half on a second
  Python thread (torch releases the interpreter lock inside ``normal_``), started right after a
  parallel matrix product, as a draw inside a training step would be.

``floor`` is ``1 + min(draw, split) / step``: the step-time ratio to non-private SGD that the
noise alone imposes when it cannot be hidden behind the model's own work, i.e. when torch's
threads use every core (dpfy draws the noise on the training thread, in the step). ``split``
shows why the draw cannot simply be spread over the cores when they are all torch's: after a
parallel region, OpenMP's threads spin, waiting for the next one, and hold the other cores for
longer than the draw takes. Times are this process's own (a machine shared with other work
varies between runs). Results go to ``benchmarks/results/noise_floor.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from step_overhead import CASES, make_case, step_function

ROUNDS = 200


def median_ms(run: Callable[[], None], rounds: int = ROUNDS) -> float:
    """Median wall time of ``run`` in milliseconds, after one warm-up call."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class HalfOnAnotherThread:
    """Draws the second half of the noise on a second thread while this one draws the first."""

    def __init__(self, halves: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.halves = halves
        self.generators = (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
        self._start, self._done = threading.Semaphore(0), threading.Semaphore(0)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._start.acquire()
            self.halves[1].normal_(generator=self.generators[1])
            self._done.release()

    def __call__(self) -> None:
        self._start.release()
        self.halves[0].normal_(generator=self.generators[0])
        self._done.acquire()


def measure(model_name: str, threads: int) -> dict[str, float | None]:
    """Step, draw and split times (ms) and the floor, at ``threads`` torch threads."""
    torch.set_num_threads(threads)
    model, x, y = make_case(model_name, "cpu")
    count = sum(p.numel() for p in model.parameters())
    step = step_function("nonprivate", model)
    noise = torch.empty(count)
    generator = torch.Generator().manual_seed(0)
    split = HalfOnAnotherThread((noise[: count // 2], noise[count // 2 :]))
    a, b = torch.randn(256, 784), torch.randn(784, 512)

    def after_product(draw: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            torch.mm(a, b)  # a parallel region first, as inside a training step
            draw()

        return run

    product = median_ms(lambda: torch.mm(a, b))
    draw = median_ms(after_product(lambda: noise.normal_(generator=generator))) - product
    halves = median_ms(after_product(split)) - product
    step_ms = median_ms(lambda: step(x, y))
    return {
        "threads": threads,
        "parameters": count,
        "step_ms": step_ms,
        "draw_ms": draw,
        "split_ms": halves,
        "floor": 1 + min(draw, halves) / step_ms if threads >= (os.cpu_count() or 1) else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=sorted(CASES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--out", default="benchmarks/results/noise_floor.json")
    args = parser.parse_args()
    rows = [measure(args.model, threads) for threads in args.threads]
    for row in rows:
        floor = "a core is idle: drawn there" if row["floor"] is None else f"{row['floor']:.2f}x"
        print(
            f"{args.model}, {row['threads']} thread(s): non-private step {row['step_ms']:.2f} ms; "
            f"noise for {row['parameters']:,} parameters: {row['draw_ms']:.2f} ms on one "
            f"thread, {row['split_ms']:.2f} ms split over two; floor: {floor}"
        )
    meta = {"torch": torch.__version__, "model": args.model}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
