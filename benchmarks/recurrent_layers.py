"""Per-example clipping of recurrent layers: the vmap engine's replay vs a per-example loop.

One step = forward, backward and the clipped sum of a model holding one nn.RNN / nn.GRU /
nn.LSTM (2 layers, bidirectional, batch first) and a linear head, on CPU. Prints, per layer type,
the median step time of: the non-private step (one backward), the fast engine (the recurrent
rule's unrolled replay), the vmap engine, and the per-example loop (one backward per example,
the reference), and their ratios, all measured in this run.

    nice -n 10 .venv/bin/python benchmarks/recurrent_layers.py [--batch 32 --steps 16 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dpfy.train.grads import GradEngine, make_engine


class Model(nn.Module):
    def __init__(self, cls: type[nn.RNNBase], features: int, hidden: int) -> None:
        super().__init__()
        self.rnn = cls(features, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, 4)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out.mean(1))


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="sequence length")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.simplefilter("ignore")
    x = torch.randn(args.batch, args.steps, args.features)
    y = torch.randint(0, 4, (args.batch,))
    print(
        f"B={args.batch} T={args.steps} d={args.features} H={args.hidden}, 2 layers, bidir, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"{'layer':6} {'plain ms':>9} {'fast ms':>9} {'vmap ms':>9} {'loop ms':>9} "
        f"{'fast/plain':>11} {'vmap/fast':>10} {'loop/fast':>10}"
    )
    for cls in (nn.RNN, nn.GRU, nn.LSTM):
        model = Model(cls, args.features, args.hidden)

        def plain(model: nn.Module = model) -> None:
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()

        def loop(model: nn.Module = model) -> None:
            total = [torch.zeros_like(p) for p in model.parameters()]
            for i in range(args.batch):
                model.zero_grad()
                nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
                grads = [p.grad for p in model.parameters()]
                norm = torch.sqrt(sum(g.square().sum() for g in grads))
                factor = min(1.0, 1.0 / float(norm))
                for t, g in zip(total, grads, strict=True):
                    t.add_(g, alpha=factor)

        t_plain = timed(plain, args.repeats)
        t_loop = timed(loop, args.repeats)
        model.zero_grad(set_to_none=True)
        times = {}
        for kind in ("fast", "vmap"):
            engine = make_engine(model, kind)

            def private(engine: GradEngine = engine, model: nn.Module = model) -> None:
                nn.functional.cross_entropy(model(x), y).backward()
                engine.clip_and_accumulate(1.0)
                engine.reset()

            times[kind] = timed(private, args.repeats)
            engine.detach()
        t_fast, t_vmap = times["fast"], times["vmap"]
        print(
            f"{cls.__name__:6} {t_plain * 1e3:9.1f} {t_fast * 1e3:9.1f} {t_vmap * 1e3:9.1f} "
            f"{t_loop * 1e3:9.1f} {t_fast / t_plain:11.1f} {t_vmap / t_fast:10.1f} "
            f"{t_loop / t_fast:10.1f}"
        )


if __name__ == "__main__":
    main()
