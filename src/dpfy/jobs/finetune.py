"""The fine-tuning job: DP fine-tuning of a public pretrained encoder, ending with a report.

:func:`run_finetune` is what ``dpfy finetune`` runs: prepare the public weights and the data
(:mod:`dpfy.jobs.finetune_setup`), make the trainable part private (σ calibrated for the target
ε), train with the ordinary loop and a progress bar, evaluate on the test split after every
epoch, optionally train the same schedule without privacy, and write the run directory like
``dpfy train``: ``report.md``, ``report.json``, ``facts.json``, ``history.json``,
``config.json``, ``model.pt`` and the plots. The report names the public weights and tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress, TaskID
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfy._safe_io import atomic_write, atomic_write_text, write_failed
from dpfy.jobs.config import public_seed
from dpfy.jobs.finetune_config import FinetuneConfig, check_finetune_config
from dpfy.jobs.finetune_setup import Prepared, prepare, public_inputs
from dpfy.jobs.progress_bars import baseline_progress, step_progress, work_progress
from dpfy.jobs.run_dir import claim_run_dir, release_run_dir
from dpfy.train.builder import make_private
from dpfy.train.session import PrivateTraining

__all__ = ["FinetuneResult", "evaluate", "run_finetune", "train_non_private", "train_private"]

OPTIMIZERS = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}


@dataclass
class FinetuneResult:
    """What the run produced: its directory, accuracies, ε and the per-epoch history."""

    run_dir: Path | None
    test_accuracy: float
    baseline_accuracy: float | None
    epsilon: float | None
    delta: float | None
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def _optimizer(config: FinetuneConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The torch optimizer over the trainable parameters only."""
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS[config.optimizer](params, config.lr)


def evaluate(model: nn.Module, data: TensorDataset, batch_size: int = 256) -> float:
    """Top-1 accuracy on rows of (*inputs, label), in eval mode."""
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for *inputs, labels in DataLoader(data, batch_size=batch_size):
            correct += int((model(*inputs).argmax(dim=1) == labels).sum())
    model.train(was_training)
    return correct / len(data)


def _progress(console: Console) -> Progress:
    """A rich progress bar with the running loss, the last test accuracy and ε so far."""
    return step_progress(
        console,
        "loss {task.fields[loss]:.3f}  test acc {task.fields[acc]:.3f}  ε {task.fields[eps]}",
    )


class _CachingProgress:
    """Feature caching's progress: one plain line and a bar with an estimate, started when the
    caching begins (so a bad model or option before it stays one error line)."""

    def __init__(self, console: Console, mode: str) -> None:
        self.console, self.mode = console, mode
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def advance(self, what: str, done: int, total: int) -> None:
        """``prepare``'s callback: ``done`` of ``total`` examples through the encoder."""
        if self._progress is None:
            self.console.print(
                f"caching the public features of {total} examples through the frozen encoder "
                f"(once; the slow part of --mode {self.mode})",
                soft_wrap=True,
            )
            self._progress = work_progress(self.console)
            self._progress.start()
            self._task = self._progress.add_task(what, total=total)
        assert self._task is not None
        self._progress.update(self._task, description=what, completed=done, total=total)

    def close(self) -> None:
        """Stop the bar, if caching began."""
        if self._progress is not None:
            self._progress.stop()


def train_private(
    private: PrivateTraining, test: TensorDataset, console: Console
) -> list[dict[str, float]]:
    """The ordinary loop (one pass over the private loader is one epoch), evaluated per epoch.

    An empty Poisson batch is still a step: no forward pass, but the private step adds its noise.
    """
    criterion = private.criterion  # make_private's cross-entropy, probed for coupled examples
    history: list[dict[str, float]] = []
    private.model.train()
    with _progress(console) as progress:
        task = progress.add_task("DP fine-tuning", total=private.plan.steps, loss=math.nan,
                                 acc=math.nan, eps="0")  # fmt: skip
        step, seen, loss_sum = 0, 0, 0.0
        for epoch in range(private.loader.epochs):
            for *inputs, labels in private.loader:
                private.optimizer.zero_grad()
                if len(labels):
                    loss = criterion(private.model(*inputs), labels)
                    loss.backward()
                    loss_sum, seen = (
                        loss_sum + float(loss.detach()) * len(labels),
                        seen + len(labels),
                    )
                private.optimizer.step()
                step += 1
                progress.update(task, advance=1, loss=loss_sum / max(seen, 1))
            row = {
                "step": step,
                "epoch": epoch + 1,
                "loss": loss_sum / max(seen, 1),
                "test_accuracy": evaluate(private.model, test),
                "epsilon": private.epsilon(),
            }
            history.append(row)
            loss_sum, seen = 0.0, 0
            progress.update(task, acc=row["test_accuracy"], eps=f"{row['epsilon']:.3f}")
    return history


def train_non_private(
    prepared: Prepared, config: FinetuneConfig, console: Console | None = None
) -> float:
    """The same model, optimizer and schedule without privacy: what DP is compared to.

    Shuffled batches of B for ⌈E⌉ epochs from the same public starting point; a progress bar
    on ``console`` (none without one).
    """
    prepared.reset()
    model = prepared.trainable
    optimizer = _optimizer(config, model)
    generator = torch.Generator().manual_seed(public_seed(config.seed))
    loader = DataLoader(prepared.train, batch_size=config.batch_size, shuffle=True,
                        generator=generator)  # fmt: skip
    criterion = nn.CrossEntropyLoss()
    epochs = max(1, math.ceil(config.epochs))
    model.train()
    with baseline_progress(console or Console(quiet=True)) as progress:
        task = progress.add_task("baseline without privacy", total=epochs * len(loader),
                                 loss=math.nan)  # fmt: skip
        for _ in range(epochs):
            for *inputs, labels in loader:
                optimizer.zero_grad()
                loss = criterion(model(*inputs), labels)
                loss.backward()
                optimizer.step()
                progress.update(task, advance=1, loss=float(loss.detach()))
    return evaluate(model, prepared.test)


def make_private_run(prepared: Prepared, config: FinetuneConfig) -> PrivateTraining:
    """The trainable part made private, from its public starting point."""
    prepared.reset()
    model = prepared.trainable
    return make_private(
        model,
        _optimizer(config, model),
        prepared.train,
        batch_size=config.batch_size,
        epochs=config.epochs,
        target_epsilon=config.target_epsilon,
        delta=config.resolved_delta(len(prepared.train)),
        max_grad_norm=config.max_grad_norm,
        engine=config.engine,
        seed=config.seed,
        criterion=nn.CrossEntropyLoss(),  # one label per text: a per-example mean, probed
    )


def default_run_dir(config: FinetuneConfig) -> Path:
    """runs/finetune-<model>-<mode>-eps<ε>-<time>: the name a run gets when --out is not given."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    eps = "nonprivate" if config.target_epsilon is None else f"eps{config.target_epsilon:g}"
    return Path("runs") / f"finetune-{config.model}-{config.mode}-{eps}-{stamp}"


def run_finetune(config: FinetuneConfig, console: Console | None = None) -> FinetuneResult:
    """Fine-tune privately, evaluate, write the run directory and the report; return figures."""
    console = console or Console()
    check_finetune_config(config)
    if config.target_epsilon is None:
        raise ValueError(
            "dpfy finetune trains privately: pass --target-epsilon (add --baseline to also "
            "train the same schedule without privacy)"
        )
    run_dir = claim_run_dir(config.out, default_run_dir(config))
    try:
        return _finetune_into(run_dir, config, console)
    finally:
        release_run_dir(run_dir)


def _finetune_into(run_dir: Path, config: FinetuneConfig, console: Console) -> FinetuneResult:
    """Prepare, train, evaluate and fill the claimed ``run_dir``."""
    from dpfy.report.facts import ResultFacts, collect_facts, record_clip_norms
    from dpfy.report.history import write_history
    from dpfy.report.render import write_report

    started = time.perf_counter()
    caching = _CachingProgress(console, config.mode)
    try:
        prepared = prepare(config, caching.advance)
    finally:
        caching.close()
    private = make_private_run(prepared, config)
    console.print(_banner(prepared, private, config))
    with record_clip_norms(private) as norms:
        history = train_private(private, prepared.test, console)
    private.detach()
    accuracy = history[-1]["test_accuracy"]
    baseline = _baseline_keeping_private(prepared, config, console) if config.baseline else None
    seconds = time.perf_counter() - started
    model = prepared.classifier.state_dict()
    atomic_write(run_dir / "model.pt", lambda path: torch.save(model, path))
    try:
        write_history(run_dir / "history.json", history)
    except OSError as err:
        raise write_failed(run_dir / "history.json", err) from None
    document = json.dumps(asdict(config), indent=2, default=str)
    atomic_write_text(run_dir / "config.json", document)
    facts = collect_facts(
        private,
        dataset_name=prepared.data.name,
        model_name=prepared.model_name,
        dataset_source=f"{prepared.data.source}; {prepared.data.split}",
        preprocessing=prepared.data.preprocessing,
        results=ResultFacts(accuracy=accuracy, baseline_accuracy=baseline,
                            evaluated_on=f"test split ({len(prepared.test)} examples)"),
        grad_norms=norms.stats(config.max_grad_norm),
        optimizer_name=config.optimizer,
        learning_rate=config.lr,
        sequence_task=True,
        loss_normalisation="per-example-mean",
        public_inputs=public_inputs(prepared),
    )  # fmt: skip
    facts = dataclasses.replace(facts, model=_whole_model_facts(prepared, private))
    try:
        write_report(facts, run_dir, history=history)
    except OSError as err:  # a full disk: one line naming the file; what was written is kept
        raise write_failed(Path(err.filename or run_dir), err) from None
    return FinetuneResult(run_dir, accuracy, baseline, private.epsilon(),
                          private.plan.delta, seconds, history)  # fmt: skip


def _baseline_keeping_private(
    prepared: Prepared, config: FinetuneConfig, console: Console
) -> float:
    """The non-private baseline's accuracy; the private model's values are put back after it
    (the baseline trains the same modules from the same starting point)."""
    private_values = {k: v.detach().clone() for k, v in prepared.trainable.state_dict().items()}
    try:
        return train_non_private(prepared, config, console)
    finally:
        prepared.trainable.load_state_dict(private_values)


def _whole_model_facts(prepared: Prepared, private: PrivateTraining) -> Any:
    """Model facts of the whole classifier (the cached bottom included), not just what trained."""
    from dpfy.report.facts import model_facts

    noised = {id(p) for p in private.engine.params.values()}
    names = [n for n, p in prepared.classifier.named_parameters() if id(p) in noised]
    return model_facts(prepared.classifier, prepared.model_name, names)


def _banner(prepared: Prepared, private: PrivateTraining, config: FinetuneConfig) -> str:
    """The one line a run prints before training: data, weights, mode, privacy and schedule."""
    plan, model = private.plan, prepared.trainable
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cached = "" if prepared.cached_layers is None else (
        f" · {prepared.cached_layers} frozen layers cached")  # fmt: skip
    return (
        f"[bold]dpfy finetune[/] {prepared.data.name} ({len(prepared.train)} examples) · "
        f"{prepared.source.describe()} · {prepared.mode.label}, {trainable:,} trainable values"
        f"{cached} · ε = {config.target_epsilon:g}, δ = {plan.delta:g} · "
        f"σ = {private.noise_multiplier:.3f}, q = {plan.sampling_rate:.4f}, {plan.steps} steps"
    )
