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
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from dpfy.data.coupling import ExamplesCoupled
from dpfy.data.provenance import BatchRefused, DrawnBatch
from dpfy.plan.sampling import SamplingKind
from dpfy.train.distributed import LocalAggregator
from dpfy.train.grads.precision import compute_dtype
from dpfy.train.optim import DPOptimizer, NonFiniteGradientError

__all__ = ["STATIC_SHAPE_SAMPLERS", "CompiledStep"]

#: Samplers whose every batch has the same number of rows: what ``compile=True`` needs (one
#: graph per shape).
STATIC_SHAPE_SAMPLERS = frozenset(
    {
        SamplingKind.TRUNCATED_POISSON,
        SamplingKind.FIXED_SIZE,
        SamplingKind.TREE_SHUFFLE,  # DP-FTRL, BandMF and BLT cut each epoch into batches of B
        SamplingKind.TREE_FIXED_ORDER,
        SamplingKind.FIXED_ORDER_EPOCHS,
    }
)

#: The module hook tables the forward pass reads; dpfy's own hooks are set aside from them.
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)

#: torch.compile modes that replay CUDA graphs, whose outputs the next replay overwrites.
_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})

#: Why the compiled step needs no model or loss probe (the card's words).
_BY_CONSTRUCTION = (
    "not needed with the compiled step: it computes each example's gradient from that example's "
    "row alone (the model and criterion run on a batch of one row under torch.func.vmap); values "
    "the model or criterion read from globals or closures are not covered"
)

#: (params, weights, *batch) → (clipped sums by name, all norms finite, mean loss of examples).
#: Names are the parameters' paths in the model as it runs (``functional_call``'s keys).
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
        _check_criterion(criterion)
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion
        self.compiled = compile
        self._params = dict(optimizer.engine.params)  # engine name → Parameter (the noise's keys)
        #: engine name → the parameter's path in the model as it runs (a substituted layer,
        #: e.g. attention, holds its parameters one level deeper than the original did)
        self._paths = _paths_in(model, self._params)
        self._device = next(iter(self._params.values())).device
        self._aside = _HooksAside(model)
        #: Each module's name and attribute dict, where a forward pass could keep a tensor.
        self._states = [(name, vars(module)) for name, module in model.named_modules()]
        self._weight_cache: dict[tuple[int, int], Tensor] = {}
        self._sized = False  # whether the per-example gradients' size was looked at
        #: CUDA graphs (these modes) overwrite a graph's outputs at its next run: keep a copy.
        self._copy_loss = compile and (compile_options or {}).get("mode") in _GRAPH_MODES
        function = _clipped_sum(model, criterion, optimizer.plan.max_grad_norm)
        self._function: ClippedSum = (
            torch.compile(function, dynamic=False, **(compile_options or {}))
            if compile
            else function
        )

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
        if not self._sized:
            self._sized = True
            _warn_if_large(rows, self._params)
        weights = self._weights(rows, examples)
        batch = tuple(t.to(self._device, non_blocking=True) for t in batch)  # the loader's, moved
        params = {self._paths[name]: p.detach() for name, p in self._params.items()}
        try:
            with self._aside.set_aside(), optimizer.engine.paused():
                sums, finite, loss = self._function(params, weights, *batch)
            _refuse_escaped(self._states)
        except Exception as err:
            optimizer.abandon()
            raise _explained(err) from err
        if not bool(finite):
            optimizer.abandon()
            raise NonFiniteGradientError(
                "a per-example gradient is NaN or infinite (a non-finite loss, or a padding row "
                "whose loss is not finite); the step was not applied and the model and ledger "
                "are unchanged — check the inputs and the loss, or lower the learning rate"
            )
        optimizer.commit(drawn, examples, lambda: self._write(sums))
        self._note_on_card()
        return loss.clone() if self._copy_loss else loss

    def _note_on_card(self) -> None:
        """The card says why the model and loss were not probed on the steps taken here."""
        behaviour = self.optimizer.behaviour
        if behaviour is not None:
            for tally in (behaviour.model.tally, behaviour.loss.tally if behaviour.loss else None):
                if tally is not None:
                    tally.skip(_BY_CONSTRUCTION)

    def _weights(self, rows: int, examples: int) -> Tensor:
        """Each row's weight in the sum: 1/B (the expected batch size) for examples, 0 padding.

        Kept per (rows, examples): a static-shape run meets a few hundred pairs at most.
        """
        weights = self._weight_cache.get((rows, examples))
        if weights is None:
            weights = torch.zeros(rows, device=self._device)
            weights[:examples] = self.optimizer.aggregation.scale
            self._weight_cache[(rows, examples)] = weights
        return weights

    def _write(self, sums: dict[str, Tensor]) -> None:
        """p.grad = (the clipped sums opened from the mechanism's noise, released) for all p."""
        aggregation = self.optimizer.aggregation
        sums = {name: sums[path] for name, path in self._paths.items()}  # the noise's keys
        opening = aggregation.opening()
        if opening is not None:  # independent noise: each sum opens from it (float32 at least)
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


#: Per-example gradient elements (rows × trainable parameters) above which the hooked step,
#: which never holds them all (per-layer rules, ghost norms), is usually the faster one
#: (measured in docs/performance.md, "The compiled step").
LARGE_PER_EXAMPLE = 1 << 24


def _warn_if_large(rows: int, params: dict[str, nn.Parameter]) -> None:
    """Say once when the step would hold a large tensor of per-example gradients."""
    elements = rows * sum(p.numel() for p in params.values())
    if elements > LARGE_PER_EXAMPLE:
        warnings.warn(
            f"the compiled step holds every example's gradient: {rows} rows × "
            f"{elements // rows:,} parameters = {elements * 4 / 2**20:,.0f} MiB in float32 per "
            "step. It pays on small models; on this one the hooked step (loss.backward(); "
            "optimizer.step()), which never holds them all, is likely faster",
            UserWarning,
            stacklevel=3,
        )


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


def _check_criterion(criterion: Callable[..., Tensor]) -> None:
    """Refuse a loss whose meaning a batch of one row would change without a word."""
    if getattr(criterion, "weight", None) is not None and (
        getattr(criterion, "reduction", "mean") == "mean"
    ):
        raise ValueError(
            "the criterion has class weights under reduction='mean', which divides by the "
            "weights of the batch's labels: on each example alone (as the compiled step "
            "computes it) the weight cancels and has no effect. Use reduction='sum' to keep each "
            "example's weight (and scale the learning rate), or drop the weights"
        )


def _paths_in(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, str]:
    """Each privatised parameter's path in ``model`` as it runs, by identity."""
    paths = {id(p): path for path, p in model.named_parameters()}
    missing = [name for name, p in params.items() if id(p) not in paths]
    if missing:
        raise ValueError(
            f"parameters {missing} are privatised but not found in the model; the compiled step "
            "needs the model that make_private was given"
        )
    return {name: paths[id(p)] for name, p in params.items()}


def _refuse_escaped(states: list[tuple[str, dict[str, Any]]]) -> None:
    """Refuse a step after which a module holds a value computed inside the per-example pass.

    A forward pass (or hook) that keeps a tensor on the module — ``self.last = h`` — would hand
    one step's examples to the next step's rows, outside clipping and accounting; under ``vmap``
    such a tensor is still a batched one, which is how it is recognised.
    """
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for name, attributes in states:
        for attribute, value in attributes.items():
            if isinstance(value, Tensor):
                escaped = wrapped(value)
            elif isinstance(value, _CONTAINERS) and attribute not in _NOT_STATE:
                escaped = _holds_batched(value)
            else:
                continue
            if escaped:
                where = f"{name}.{attribute}" if name else attribute
                raise ExamplesCoupled(
                    f"the model kept a value computed from this step's examples ({where!r}, set "
                    "in its forward pass or a hook); the next step would read it, so one step's "
                    "examples would reach another's rows unclipped. The step was refused before "
                    "the update; keep no tensor of the forward pass on the model, or train with "
                    "the hooked step"
                )


#: Containers a kept tensor could sit in.
_CONTAINERS = (dict, list, tuple, set)
#: A module's own containers that cannot hold a kept tensor of the pass: children, parameters
#: (assigning a plain tensor to one is refused by torch) and the hook tables.
_NOT_STATE = frozenset(
    {
        "_modules",
        "_parameters",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
        *_HOOK_TABLES,
    }
)


def _holds_batched(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` (or a container of it, ``depth`` levels down) is a batched tensor."""
    if isinstance(value, Tensor):
        return torch._C._functorch.is_functorch_wrapped_tensor(value)
    if depth and isinstance(value, dict):
        return any(_holds_batched(v, depth - 1) for v in value.values())
    if depth and isinstance(value, (list, tuple, set)):
        return any(_holds_batched(v, depth - 1) for v in value)
    return False


def _clipped_sum(model: nn.Module, criterion: Callable[..., Tensor], clip: float) -> ClippedSum:
    """(params, weights, *batch) → (Σ_i w_i·clip_C(g_i) by name, all ‖g_i‖ finite, mean loss).

    Per-example gradients are ``vmap`` of ``grad`` of the model and criterion on one row (guide
    alg. 1); each row is scaled by min(1, C/‖g_i‖) over all parameters together, times its weight.
    Buffers are read from the model itself (unbatched: a write into one fails under ``vmap``).
    Norms, clip factors and sums are formed in float32 at least with autocast off, as the engine
    forms them (:mod:`dpfy.train.grads.precision`): in half precision a clipped row could exceed
    C by rounding. The mean loss is over rows of weight > 0 (the examples), for progress only.
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
        with torch.autocast(weights.device.type, enabled=False):
            wide = {name: g.to(compute_dtype(g.dtype)) for name, g in grads.items()}
            squares = [g.flatten(1).square().sum(1) for g in wide.values()]
            norms = torch.stack(squares).sum(0).sqrt()
            factors = clip / norms.clamp(min=clip) * weights  # 1 when ‖g‖ ≤ C; never ÷ 0
            sums = {
                name: torch.tensordot(factors.to(g.dtype), g, dims=1) for name, g in wide.items()
            }
            examples = weights > 0
            real = torch.where(examples, losses.float(), 0.0)  # a padding row's NaN left out
            loss = real.sum() / examples.sum().clamp(min=1)
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


def _explained(err: Exception) -> Exception:
    """What a failure inside the per-example pass means for the user (a refusal stays itself)."""
    if isinstance(err, BatchRefused):
        return err
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    cause = lines[-1] if lines else type(err).__name__
    return ValueError(
        f"the model or criterion could not run on one example at a time under torch.func.vmap "
        f"({type(err).__name__}: {cause}). Usual causes: a forward pass that writes into the "
        "model's parameters or buffers (BatchNorm's running statistics in training: use "
        "GroupNorm or LayerNorm), one that reads a value back to Python (.item(), a "
        "data-dependent if), or a layer torch.func cannot batch (nn.GRU). Fix that, or train "
        "with the hooked step (loss.backward(); optimizer.step()). Nothing was changed"
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
