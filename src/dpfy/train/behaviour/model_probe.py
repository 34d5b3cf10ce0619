"""The model, probed: does an example's output change when the rest of its batch is replaced?

On scheduled batches, after the model's forward pass, the model runs once more (no gradients,
dpfy's capture paused) on the same batch with every row but a few probed ones replaced by a copy
of the first probed example, under the random state the real pass started from: same shapes,
same dropout masks. A model that treats examples independently gives the probed rows the very
outputs they had; batch statistics (``h - h.mean(0)``, a hand-written batch norm), a layer fed a
slice of the batch (``h[:1]``) or a mixup across rows do not. The module where the coupling
enters is then found by comparing every submodule's inputs and outputs on the probed rows across
the two passes: the first that receives the same rows but returns different ones is named. The
probed rows are examples, never a static-shape batch's padding rows (which are replaced as the
other rows are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpfy.data.check_schedule import CheckSchedule
from dpfy.data.coupling import CheckTally
from dpfy.data.row_compare import batch_rows, first_difference, leaves, take_rows
from dpfy.train.behaviour.example_rows import UNKNOWN_PADDING, ExampleCount, all_rows
from dpfy.train.behaviour.rng_replay import RandomState
from dpfy.train.grads.engine import GradEngine

#: How many examples one probe follows (each keeps its row; the others are replaced).
_PROBED = 2


class ModelProbe:
    """Hooks on the model's own forward that probe it on scheduled batches."""

    def __init__(
        self,
        engine: GradEngine,
        schedule: CheckSchedule,
        batch_number: Callable[[], int | None],
        report: Callable[[int, str], None],
        examples: ExampleCount = all_rows,
    ) -> None:
        self.model = engine.model
        self.engine = engine
        self.schedule = schedule
        self.batch_number = batch_number
        self.report = report  # (batch number, problem): a coupling found on that batch
        self.examples = examples  # rows of a pass → its leading example rows (the rest: padding)
        self.tally = CheckTally("model")
        self.dim = 0 if engine.batch_first else 1
        self._rows = torch.Generator().manual_seed(0)  # which rows: never the user's stream
        self._pending: tuple[_Start, tuple[Any, ...], dict[str, Any]] | None = None
        self._busy = False
        self._handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        if schedule.off:
            self.tally.skip("the independence checks were turned off")

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()

    def _due(self) -> int | None:
        """The batch number if this forward pass is a training pass to probe, else None."""
        if self._busy or not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
            return None
        number = self.batch_number()
        return number if number is not None and self.schedule.due(number) else None

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep the random state and a copy of the inputs the pass starts from."""
        self._pending = None
        if self._due() is not None:
            start = _Start(RandomState(self.model), _copied(_buffers(self.model)))
            self._pending = (start, _copied(args), _copied(kwargs))

    def _after(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        """Probe the pass that just ended, if it was one to probe."""
        pending, self._pending = self._pending, None
        number = self._due()
        if pending is None or number is None:
            return
        self._busy = True
        try:
            problem = self._probe(*pending, output)
        except Exception as err:  # the card states the check did not run, and why
            self.tally.skip(f"the model could not be run again on a probe batch ({err})")
            return
        finally:
            self._busy = False
        if problem is None:
            return
        self.tally.found(*problem)
        self.report(number, problem[0])

    def _probe(
        self, start: _Start, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> tuple[str, str] | None:
        """The coupling this batch shows and where, or None (tallied as passed or skipped)."""
        if _holds_packed((args, kwargs)):
            self.tally.skip("packed sequences have no batch dimension whose rows can be replaced")
            return None
        size = _batch_size((args, kwargs), self.dim)
        real = None if size is None else self.examples(size)
        if size is not None and real is None:
            self.tally.skip(UNKNOWN_PADDING)
            return None
        if size is None or real is None or real < 2:
            self.tally.skip("batches of fewer than two examples have nothing to couple")
            return None
        rows = self._probed_rows(real)
        index = torch.full((size,), int(rows[0]), dtype=torch.long)
        index[rows] = rows
        filled = take_rows((args, kwargs), size, index, self.dim)
        seen = self._rerun(filled, start)
        problem = first_difference(  # per-example outputs only: a batch-mean loss is not one
            batch_rows(output, size, rows, self.dim), batch_rows(seen, size, rows, self.dim)
        )
        if problem is None:
            self.tally.passed()
            return None
        where = self._localise((args, kwargs), filled, size, rows, start)
        message = (
            f"the model: example {int(rows[-1])}'s output changed when the other examples of its "
            f"batch were replaced ({problem}); the examples are mixed in {where}, e.g. by "
            "batch statistics (h.mean(0), h.std(0), a hand-written batch norm), a slice of the "
            "batch fed to a layer (h[:1]) or a mix of rows (mixup). Clipping then does not bound "
            "one example's influence. Fix: per-example computations only — GroupNorm or "
            "LayerNorm instead of batch statistics, no reduction or slicing over the batch "
            "dimension"
        )
        return message, where

    def _probed_rows(self, real: int) -> torch.Tensor:
        """A few example rows (of the first ``real``; padding rows follow them), never the first
        or last example (layers fed ``h[:1]`` or ``h[-1:]`` show then)."""
        if real < 3:
            return torch.tensor([real - 1])
        inner = torch.randperm(real - 2, generator=self._rows)[:_PROBED] + 1
        return inner.sort().values

    def _rerun(self, inputs: tuple[tuple[Any, ...], dict[str, Any]], start: _Start) -> Any:
        """The model on ``inputs`` from the pass's starting state; its buffers are kept as is.

        Buffers (e.g. spectral normalisation's power-iteration vectors) are set to what they
        held when the probed pass began, and afterwards back to what that pass left.
        """
        after = _buffers(self.model)
        kept = {key: tensor.detach().clone() for key, tensor in after.items()}
        args, kwargs = inputs
        try:
            for key, tensor in after.items():
                if key in start.buffers and start.buffers[key].shape == tensor.shape:
                    tensor.data.copy_(start.buffers[key])
            with self.engine.paused(), torch.no_grad(), start.random.replayed():
                return self.model(*args, **kwargs)
        finally:
            for (module, name), tensor in after.items():
                module._buffers[name] = tensor
                tensor.data.copy_(kept[(module, name)])

    def _localise(
        self,
        batch: tuple[tuple[Any, ...], dict[str, Any]],
        filled: tuple[tuple[Any, ...], dict[str, Any]],
        size: int,
        rows: torch.Tensor,
        start: _Start,
    ) -> str:
        """The first module to get the probed rows unchanged but return them changed."""
        passes = [self._calls(inputs, size, rows, start) for inputs in (batch, filled)]
        if len(passes[0]) == len(passes[1]):
            for (name, kind, x, y), (_, _, x2, y2) in zip(*passes, strict=True):
                if first_difference(x, x2) is None and first_difference(y, y2) is not None:
                    return f"'{name}' ({kind})"
        return f"the model's own forward ({type(self.model).__name__})"

    def _calls(
        self,
        inputs: tuple[tuple[Any, ...], dict[str, Any]],
        size: int,
        rows: torch.Tensor,
        start: _Start,
    ) -> list[tuple[str, str, Any, Any]]:
        """Every submodule call of one pass, in the order calls end: the probed rows in and out."""
        calls: list[tuple[str, str, Any, Any]] = []

        def record(name: str, module: nn.Module, args: Any, output: Any) -> None:
            rows_in = _copied(take_rows(args, size, rows, self.dim))
            rows_out = _copied(take_rows(output, size, rows, self.dim))
            calls.append((name, type(module).__name__, rows_in, rows_out))

        handles = [
            module.register_forward_hook(partial(record, name))
            for name, module in self.model.named_modules()
            if module is not self.model
        ]
        try:
            self._rerun(inputs, start)
        finally:
            for handle in handles:
                handle.remove()
        return calls


@dataclass(frozen=True)
class _Start:
    """What a probed pass started from: the random state and the model's buffers."""

    random: RandomState
    buffers: dict[tuple[nn.Module, str], torch.Tensor]


def _buffers(model: nn.Module) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """Every buffer of the model by (owning module, name)."""
    return {
        (module, name): tensor
        for module in model.modules()
        for name, tensor in module._buffers.items()
        if tensor is not None
    }


def _batch_size(inputs: Any, dim: int) -> int | None:
    """The batch size: the first input tensor's size along the batch dimension."""
    for _, leaf in leaves(inputs):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
            return int(leaf.shape[dim])
    return None


def _holds_packed(tree: Any) -> bool:
    """Whether ``tree`` holds a PackedSequence (its rows are time steps of many examples)."""
    if isinstance(tree, PackedSequence):
        return True
    if isinstance(tree, dict):
        return any(_holds_packed(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_holds_packed(v) for v in tree)
    return False


def _copied(tree: Any) -> Any:
    """``tree`` with every tensor leaf cloned (a forward pass may modify its inputs in place)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_copied(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copied(v) for v in tree)
    return tree
