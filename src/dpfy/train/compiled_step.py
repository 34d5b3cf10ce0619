"""The compiled private step: per-example gradients by ``torch.func``, one function of the batch.

Why: the hooked step (:class:`~dpfy.train.optim.DPOptimizer` over the engine) runs Python in
every layer's hooks on every step, which is most of a small model's step on a CPU and what keeps
a GPU waiting on kernel launches. Here the whole clip-and-sum is one pure function of the
parameters and the batch — ``vmap`` over rows of ``grad`` of the model and criterion on a batch
of one row, each row's norm, the clip factors times each row's weight, and the weighted sums —
which ``torch.compile`` turns into one graph per batch shape. Truncated Poisson batches
(``sampler="truncated-poisson"``, :mod:`dpfy.data.padding`) all have the same M rows, so it
compiles once (figures and compile times: docs/performance.md).

What it guarantees, by construction or by check, before anything changes:

- each example's gradient depends on that example alone: the model and criterion see a batch of
  one row under ``vmap``, so no batch statistic, loss normalised over the batch or mixing layer
  can couple examples (a model that writes its buffers, e.g. BatchNorm in training, is refused);
- the batch is the private loader's last, whole and unchanged: the tensors given must be the very
  tensors it handed out, not written in place since
  (:meth:`~dpfy.data.provenance.Provenance.check_handed`);
- padding rows weigh exactly 0 and are not counted; a non-finite gradient on any row refuses
  the step;
- the rest is the hooked step's: every trainable parameter is one that is privatised, the state
  watch, the collate probe and the budget guard refuse before anything changes, the plan's noise
  mechanism opens each sum and releases it (:class:`~dpfy.train.private_aggregation
  .PrivateAggregation`, ÷ the expected batch size), and the ledger records the step
  (:meth:`~dpfy.train.optim.DPOptimizer.commit`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dpfy.data.provenance import BatchRefused, DrawnBatch
from dpfy.plan.sampling import SamplingKind
from dpfy.train.distributed import LocalAggregator
from dpfy.train.optim import DPOptimizer, NonFiniteGradientError

__all__ = ["STATIC_SHAPE_SAMPLERS", "CompiledStep"]

#: Samplers whose every batch has the same number of rows: what ``compile=True`` needs (one
#: graph per shape).
STATIC_SHAPE_SAMPLERS = frozenset({SamplingKind.TRUNCATED_POISSON, SamplingKind.FIXED_SIZE})

#: The module hook tables the forward pass reads; dpfy's own hooks are set aside from them.
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)

#: Why the compiled step needs no model or loss probe (the card's words).
_BY_CONSTRUCTION = (
    "not needed with the compiled step: it computes each example's gradient from that example "
    "alone (the model and criterion run on a batch of one row under torch.func.vmap)"
)

#: (params, weights, *batch) → (clipped sums by name, all norms finite, mean loss of examples).
ClippedSum = Callable[..., tuple[dict[str, Tensor], Tensor, Tensor]]


class CompiledStep:
    """``loss = step(*inputs, target)``: one private step on the loader's batch.

    ``criterion(output, target)`` is applied to each example alone (a batch of one row), so a
    loss normalised over the batch takes its per-example form. Returns the mean loss of the
    batch's examples (detached; padding rows left out).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: DPOptimizer,
        criterion: Callable[..., Tensor],
        *,
        compile: bool = True,
        compile_options: dict[str, Any] | None = None,
    ) -> None:
        _check_fits(optimizer, compile)
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion
        self.compiled = compile
        self._params = dict(optimizer.engine.params)  # name → Parameter, the privatised ones
        self._aside = _HooksAside(model)
        self._weight_cache: dict[tuple[int, int], Tensor] = {}
        function = _clipped_sum(model, criterion, optimizer.plan.max_grad_norm)
        self._function: ClippedSum = (
            torch.compile(function, dynamic=False, **(compile_options or {}))
            if compile
            else function
        )
        behaviour = optimizer.behaviour
        if behaviour is not None:  # the card says why the model and loss were not probed
            for tally in (behaviour.model.tally, behaviour.loss.tally if behaviour.loss else None):
                if tally is not None:
                    tally.skip(_BY_CONSTRUCTION)

    def __call__(self, *batch: Tensor) -> Tensor:
        """Clip, sum, noise, update and record one step on the loader's last batch."""
        if len(batch) < 2 or not all(isinstance(t, Tensor) for t in batch):
            raise TypeError(
                "call the compiled step as step(*inputs, target) with the tensors of the loader's "
                "batch, e.g. `for x, y in private.loader: loss = step(x, y)`"
            )
        optimizer = self.optimizer
        drawn = optimizer.take_handed(batch)
        rows = int(batch[0].shape[0])
        examples = _examples(drawn, rows, batch)
        weights = self._weights(rows, examples)
        params = {name: p.detach() for name, p in self._params.items()}
        try:
            with self._aside.set_aside(), optimizer.engine.paused():
                sums, finite, loss = self._function(params, weights, *batch)
        except RuntimeError as err:
            optimizer._abandon()
            raise _explained(err) from err
        if not bool(finite):
            optimizer._abandon()
            raise NonFiniteGradientError(
                "a per-example gradient is NaN or infinite (a non-finite loss, or a padding row "
                "whose loss is not finite); the step was not applied and the model and ledger "
                "are unchanged — check the inputs and the loss, or lower the learning rate"
            )
        optimizer.commit(drawn, examples, lambda: self._write(sums))
        return loss

    def _weights(self, rows: int, examples: int) -> Tensor:
        """Each row's weight in the sum: 1/B (the expected batch size) for examples, 0 padding.

        Kept per (rows, examples): a static-shape run meets a few hundred pairs at most.
        """
        weights = self._weight_cache.get((rows, examples))
        if weights is None:
            device = next(iter(self._params.values())).device
            weights = torch.zeros(rows, device=device)
            weights[:examples] = self.optimizer.aggregation.scale
            self._weight_cache[(rows, examples)] = weights
        return weights

    def _write(self, sums: dict[str, Tensor]) -> None:
        """p.grad = (the clipped sums opened from the mechanism's noise, released) for all p."""
        aggregation = self.optimizer.aggregation
        opening = aggregation.opening()
        if opening is not None:  # independent noise: each sum opens from it
            for name, total in sums.items():
                noise = torch.empty_like(total)
                opening.fill(name, noise)
                sums[name] = noise.add_(total)
        noisy = self.optimizer.aggregator.combine(aggregation.release(sums))
        for name, total in noisy.items():
            param = self._params[name]
            param.grad = total if total.dtype == param.dtype else total.to(param.dtype)

    def __repr__(self) -> str:
        """What the step does and how it is run."""
        how = "compiled" if self.compiled else "eager"
        return f"CompiledStep({how}, {self.optimizer!r})"


def _check_fits(optimizer: DPOptimizer, compile: bool) -> None:
    """Refuse a run this step cannot take exactly (one clear message each)."""
    if optimizer.clipping_unit != "example":
        raise ValueError(
            f"the compiled step clips each example; this run clips per {optimizer.clipping_unit} "
            "— train it with the hooked step (loss.backward(); optimizer.step())"
        )
    if not isinstance(optimizer.aggregator, LocalAggregator):
        raise ValueError(
            "the compiled step runs in one process; a distributed run trains with the hooked "
            "step (loss.backward(); optimizer.step())"
        )
    if not optimizer.engine.batch_first:
        raise ValueError("the compiled step needs batch_first=True (rows on dimension 0)")
    kind = SamplingKind.parse(optimizer.plan.sampler)
    if compile and kind not in STATIC_SHAPE_SAMPLERS:
        raise ValueError(
            f"compile=True needs every batch to have the same number of rows, which "
            f"sampler={kind.value!r} does not give (one compilation per shape); use "
            "sampler='truncated-poisson' with max_batch_size=M in make_private, or compile=False"
        )


def _clipped_sum(model: nn.Module, criterion: Callable[..., Tensor], clip: float) -> ClippedSum:
    """(params, weights, *batch) → (Σ_i w_i·clip_C(g_i) by name, all ‖g_i‖ finite, mean loss).

    Per-example gradients are ``vmap`` of ``grad`` of the model and criterion on one row (guide
    alg. 1); each row is scaled by min(1, C/‖g_i‖) over all parameters together, times its weight.
    Buffers are read from the model itself (unbatched: a write into one fails under ``vmap``).
    The mean loss is over rows of weight > 0 (the examples), for the caller's progress only.
    """

    def loss_of_one(params: dict[str, Tensor], *row: Tensor) -> tuple[Tensor, Tensor]:
        inputs = tuple(t.unsqueeze(0) for t in row[:-1])
        output = functional_call(model, params, inputs, strict=False)
        loss = criterion(output, row[-1].unsqueeze(0))
        if loss.numel() != 1:
            raise ValueError(
                "the criterion must return one number for a batch of one example (reduction "
                f"'mean' or 'sum'), not a tensor of shape {tuple(loss.shape)}"
            )
        loss = loss.reshape(())
        return loss, loss.detach()

    per_example = grad(loss_of_one, has_aux=True)

    def clipped_sum(
        params: dict[str, Tensor], weights: Tensor, *batch: Tensor
    ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        in_dims = (None, *([0] * len(batch)))
        grads, losses = vmap(per_example, in_dims=in_dims, randomness="different")(params, *batch)
        squares = [g.flatten(1).float().square().sum(1) for g in grads.values()]
        norms = torch.stack(squares).sum(0).sqrt()
        factors = clip / norms.clamp(min=clip) * weights  # 1 when ‖g‖ ≤ C; never ÷ 0
        sums = {name: torch.tensordot(factors.to(g.dtype), g, dims=1) for name, g in grads.items()}
        examples = weights > 0
        loss = (losses * examples).sum() / examples.sum().clamp(min=1)
        return sums, torch.isfinite(norms).all(), loss

    return clipped_sum


def _examples(drawn: DrawnBatch, rows: int, batch: tuple[Tensor, ...]) -> int:
    """How many of the batch's rows are examples; every tensor must have its rows."""
    for tensor in batch:
        if tensor.dim() == 0 or int(tensor.shape[0]) != rows:
            raise BatchRefused(
                "every tensor given to the compiled step must hold the batch's rows on dimension "
                f"0; got shapes {[tuple(t.shape) for t in batch]}"
            )
    if drawn.padding is None:
        return rows
    drawn.padding.check_rows(rows)
    return drawn.padding.real


def _explained(err: RuntimeError) -> Exception:
    """What a failure inside the per-example function means for the user."""
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(
        f"the model or criterion could not run on one example at a time under torch.func.vmap "
        f"({first}). Usual causes: a forward pass that writes into the model's parameters or "
        "buffers (BatchNorm's running statistics in training: use GroupNorm or LayerNorm), "
        "or one that reads a value back to Python (.item(), data-dependent if). Fix that, or "
        "train with the hooked step (loss.backward(); optimizer.step()). Nothing was changed"
    )


class _HooksAside:
    """The model's forward and backward hooks that belong to dpfy, set aside during the step.

    The engine's taps and the behaviour probes watch the hooked step; the compiled step needs
    none of them, and tracing them would break the graph. The user's own hooks stay. The tables
    used while set aside are kept between steps, so a compiled graph's guards keep holding.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        #: The modules' attribute dicts, where the hook tables live (written directly: a table
        #: is a plain attribute, and ``nn.Module.__setattr__`` would cost more than the step's
        #: arithmetic on a small model). dpfy hooks only modules that exist at make_private.
        self._slots = [vars(module) for module in model.modules()]
        self._kept: dict[tuple[int, str], tuple[tuple[int, ...], OrderedDict[int, Any]]] = {}

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Within the block each module's hook tables hold only hooks that are not dpfy's."""
        swapped: list[tuple[dict[str, Any], str, OrderedDict[int, Any]]] = []
        try:
            for slots in self._slots:
                for table in _HOOK_TABLES:
                    hooks = slots[table]
                    if hooks:
                        swapped.append((slots, table, hooks))
                        slots[table] = self._without_dpfy(id(slots), table, hooks)
            yield
        finally:
            for slots, table, hooks in reversed(swapped):
                slots[table] = hooks

    def _without_dpfy(
        self, module: int, table: str, hooks: OrderedDict[int, Any]
    ) -> OrderedDict[int, Any]:
        """``hooks`` less dpfy's, the same table object as last step when nothing changed."""
        key = (module, table)
        ids = tuple(hooks)
        kept = self._kept.get(key)
        if kept is None or kept[0] != ids:
            kept = (ids, OrderedDict((i, h) for i, h in hooks.items() if not _is_dpfy(h)))
            self._kept[key] = kept
        return kept[1]


def _is_dpfy(hook: Any) -> bool:
    """Whether a hook's code is dpfy's (a function, bound method or partial of one)."""
    while hasattr(hook, "func"):  # functools.partial
        hook = hook.func
    module = getattr(hook, "__module__", None) or ""
    return module == "dpfy" or module.startswith("dpfy.")
