"""DP-SGD across processes (torch.distributed): the same guarantee as one process, one ledger.

Why this preserves the single-process guarantee (central DP, guide §3.1, alg. 1):

- **Sampling.** Each rank Poisson-samples its own disjoint shard of the whole dataset at the
  *global* rate q = B/N with an independently seeded stream
  (:class:`~dpfy.data.sharding.ShardedPoissonSampler`), so the union of the local batches is a
  Poisson sample of the whole dataset at rate q — the event the ledger accounts.
- **Clipping** is per example, on the rank that holds the example, with the same C everywhere.
- **Aggregation.** The clipped sums are added up across ranks with one all-reduce per logical
  batch, every rank taking part in every step (an empty local batch contributes zeros).
- **Noise exactly once.** Each of the W ranks adds an independent share N(0, σ²C²/W) to its local
  clipped sum before the all-reduce; the shares sum to N(0, σ²C²), exactly the single-process
  noise. Shares rather than one noising rank because (i) no single rank's generator decides the
  noise, so one predictable or replayed stream does not expose the sum; (ii) every rank runs the
  same code path, with no special rank; (iii) the all-reduce never carries a noiseless sum. The
  price is that the shares must be independent: each rank's noise (and sampling) stream is seeded
  separately — from the OS by default, or from :func:`derive_seed` (user seed, rank, purpose) when
  a seed is given. A resume starts every rank's noise stream afresh (from the OS, or from that
  rank's seed and the step resumed at): no rank replays the noise it drew before.
- **Division by the global expected batch size** B = qN, never a local or realised
  size; every rank ends with the same noisy averaged gradient and applies the same update.
- **One ledger.** Every rank records the same step (same σ, q, record) and so holds an identical
  ledger; :func:`ProcessGroupReplicas.verify_ledger` checks it. At start-up
  :meth:`ProcessGroupReplicas.check_agreement` refuses ranks that disagree on N, B, q, σ, C,
  steps, δ, accountant or the model's trainable parameters.

Trust model: central DP. The ranks and the aggregation are trusted (they see clipped, not yet
fully noised, partial sums); what is protected is what the run releases — the model and reports.
Checkpoints are not releases: they hold every rank's sampler state, from which past batches can be
reconstructed, so they must stay as private as the data. They hold no noise generator state.

Failures: every collective is wrapped; if another rank crashed, was killed, skipped a step or the
network failed, the collective fails (at once, or after the process-group timeout) and this rank
raises :class:`PeerFailure` before the step changes its model or ledger, so the last checkpoint
(written by rank 0, holding every rank's sampler state) remains a valid resume point.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from dpfy.data.sampling import DpBatchSampler, epoch_length, make_sampler, sampling_rate_for
from dpfy.data.sharding import ShardedPoissonSampler
from dpfy.plan.sampling import SamplingKind

T = TypeVar("T")
_SEED_PURPOSES = {"sampling": 0, "noise": 1}
_ACCOUNTED = ("accountant", "relation", "delta", "target_epsilon", "entries")


class PeerFailure(RuntimeError):
    """A collective failed: another rank most likely stopped; this rank's step was not applied."""


class RanksOutOfStep(RuntimeError):
    """Ranks reached the same collective at different steps (one skipped or repeated a step)."""


class RankMismatch(ValueError):
    """Ranks disagree on a setting the privacy guarantee depends on; nothing was started."""


class GradientAggregator(Protocol):
    """Turns this rank's noised clipped sums into the noisy total the optimizer divides by B.

    Each rank adds its own noise share of std ``share_std(std)`` to its clipped sum (the
    optimizer opens each sum from it); ``combine`` sums those over the ranks,
    so the total carries N(0, std²) per coordinate exactly once.
    """

    def share_std(self, std: float) -> float:
        """The std of this rank's share, so that the shares of all ranks add up to ``std``."""
        ...

    def combine(self, noised: dict[str, Tensor]) -> dict[str, Tensor]:
        """Σ over all ranks of each rank's noised clipped sums, per parameter."""
        ...

    def skip(self) -> None:
        """This rank abandons the current logical batch (its step was refused or failed)."""
        ...


class LocalAggregator:
    """One process: the clipped sum plus the whole noise, no communication."""

    def share_std(self, std: float) -> float:
        """The only rank adds all the noise."""
        return std

    def combine(self, noised: dict[str, Tensor]) -> dict[str, Tensor]:
        """Nothing to sum over: this rank's noised sums are the total."""
        return noised

    def skip(self) -> None:
        """Nothing to keep in step with."""


def derive_seed(seed: int, rank: int, purpose: str) -> int:
    """An independent 63-bit seed for (seed, rank, purpose), by NumPy's SeedSequence hashing.

    Ranks must not share streams (see :mod:`dpfy.data.sharding`); adding the rank to the seed
    would make run (seed=1, rank=0) replay run (seed=0, rank=1), so the seed is hashed instead.
    """
    if purpose not in _SEED_PURPOSES:
        raise ValueError(f"purpose must be one of {', '.join(_SEED_PURPOSES)}; got {purpose!r}")
    entropy = int(seed) % (1 << 64)  # torch accepts negative seeds; SeedSequence does not
    sequence = np.random.SeedSequence(entropy, spawn_key=(int(rank), _SEED_PURPOSES[purpose]))
    return int(sequence.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


class SingleProcess:
    """The replicas of a one-process run: one rank, nothing to gather, nothing to wait for."""

    rank = 0
    world_size = 1
    is_writer = True

    def sampling_seed(self, seed: int) -> int:
        """The user's seed, as before distributed training existed."""
        return seed

    def noise_seed(self, seed: int) -> int:
        """seed + 1: the noise stream differs from the sampling stream."""
        return seed + 1

    def aggregator(self) -> GradientAggregator:
        """Local noise, no communication."""
        return LocalAggregator()

    def sampler(
        self,
        kind: SamplingKind,
        dataset_size: int,
        batch_size: int,
        steps: int,
        generator: torch.Generator | None,
        secure: bool = False,
        max_batch_size: int | None = None,
    ) -> DpBatchSampler:
        """The run's ``steps`` drawn by a sampler of this kind, one epoch (N / B steps) per pass."""
        return make_sampler(
            kind, dataset_size, batch_size, epoch_length(dataset_size, batch_size), generator,
            secure=secure, total=steps, max_batch_size=max_batch_size,
        )  # fmt: skip

    def gather(self, state: T) -> T:
        """A one-process checkpoint holds this process's state as is."""
        return state

    def mine(self, state: Any) -> Any:
        """The state to load; refuses a checkpoint written by a multi-rank run."""
        if isinstance(state, Mapping) and "ranks" in state:
            raise ValueError(
                f"the checkpoint was written by a distributed run of {len(state['ranks'])} ranks; "
                "resume it with the same number of ranks (torchrun --nproc-per-node …)"
            )
        return state

    def barrier(self) -> None:
        """Nothing to wait for."""

    def on_writer(self, task: Callable[[], T]) -> T:
        """Run ``task`` here: the only process is the writer."""
        return task()

    def check_agreement(self, values: Mapping[str, Any]) -> None:
        """One process always agrees with itself."""

    def broadcast_model(self, model: nn.Module) -> None:
        """Nothing to synchronise."""

    def verify_ledger(self, ledger: Any) -> None:
        """One ledger, trivially identical."""

    def prepare(self, engine: Any, behaviour: Any) -> None:
        """Nothing to adapt: the engine and every behaviour check run as in one process."""

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model's state dict as a checkpoint holds it."""
        return model.state_dict()

    def load_model_state(self, model: nn.Module, state: Mapping[str, Any]) -> None:
        """Load a checkpoint's model state."""
        model.load_state_dict(state)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The wrapped optimizer's state as a checkpoint holds it."""
        return optimizer.state_dict()

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any
    ) -> None:
        """Load a checkpoint's optimizer state."""
        optimizer.load_state_dict(state)


class ProcessGroupReplicas:
    """The ranks of the default torch.distributed process group, training one model together."""

    def __init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "distributed=True needs an initialised process group: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment), "
                "or leave distributed=None"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.is_writer = self.rank == 0
        self._device = _collective_device()

    def sampling_seed(self, seed: int) -> int:
        """This rank's own sampling stream."""
        return derive_seed(seed, self.rank, "sampling")

    def noise_seed(self, seed: int) -> int:
        """This rank's own noise-share stream."""
        return derive_seed(seed, self.rank, "noise")

    def aggregator(self) -> GradientAggregator:
        """All-reduce of noise shares, with a step-sequence check."""
        return AllReduceAggregator(self)

    def sampler(
        self,
        kind: SamplingKind,
        dataset_size: int,
        batch_size: int,
        steps: int,
        generator: torch.Generator | None,
        secure: bool = False,
        max_batch_size: int | None = None,
    ) -> DpBatchSampler:
        """This rank's shard, Poisson-sampled at the global q = B/N; other samplers refused.

        Every rank cuts the run's ``steps`` into the same epochs of N / B steps.
        """
        if kind is not SamplingKind.POISSON:
            raise ValueError(
                f"distributed training supports Poisson sampling only, got {kind.value!r}: "
                "sharded shuffled or fixed-size batches are not the sampling any accountant "
                "here describes; use sampler='poisson'"
            )
        rate = sampling_rate_for(dataset_size, batch_size)
        return ShardedPoissonSampler(
            dataset_size, rate, epoch_length(dataset_size, batch_size), self.rank, self.world_size,
            generator, secure=secure, total=steps,
        )  # fmt: skip

    def run(self, what: str, collective: Callable[[], T]) -> T:
        """Run a collective, turning a communication failure into one clear :class:`PeerFailure`."""
        try:
            return collective()
        except (RankMismatch, RanksOutOfStep, NotImplementedError):
            raise  # a refusal, or an operation torch cannot do here: not a stopped peer
        except RuntimeError as err:
            raise PeerFailure(
                f"rank {self.rank} of {self.world_size}: the {what} failed ({err}). Most likely "
                "another rank stopped (it crashed, was killed, raised an error such as "
                "NonFiniteGradientError, or left the training loop early) or the network between "
                "ranks failed; the process-group timeout bounds how long this takes to notice. "
                "This rank's model and ledger were not changed by the failed step. Stop every rank "
                "and resume all of them from the last checkpoint."
            ) from err

    def gather(self, state: T) -> dict[str, Any]:
        """Every rank's ``state``, in rank order (collective: every rank must call it)."""
        states: list[Any] = [None] * self.world_size
        self.run("gathering of checkpoint state", lambda: dist.all_gather_object(states, state))
        return {"world_size": self.world_size, "ranks": states}

    def mine(self, state: Any) -> Any:
        """This rank's entry of a gathered state; refuses another world size or a 1-rank state."""
        if not (isinstance(state, Mapping) and "ranks" in state):
            raise ValueError(
                "the checkpoint was written by a one-process run; resume it without "
                f"torch.distributed (this run has {self.world_size} ranks)"
            )
        if len(state["ranks"]) != self.world_size:
            raise ValueError(
                f"the checkpoint was written by {len(state['ranks'])} ranks and this run has "
                f"{self.world_size}; resume with the same number of ranks"
            )
        return state["ranks"][self.rank]

    def barrier(self) -> None:
        """Wait for every rank (e.g. until rank 0 has written the checkpoint)."""
        self.run("barrier", lambda: dist.barrier())

    def on_writer(self, task: Callable[[], T]) -> T:
        """Run ``task`` on rank 0 only; all ranks get its result or its ValueError (collective)."""
        outcome: list[Any] = [None, None]
        if self.is_writer:
            try:
                outcome[0] = task()
            except ValueError as err:
                outcome[1] = str(err)
        self.run("broadcast from rank 0", lambda: dist.broadcast_object_list(outcome, src=0))
        if outcome[1] is not None:
            raise ValueError(outcome[1])
        return outcome[0]

    def check_agreement(self, values: Mapping[str, Any]) -> None:
        """Refuse to start unless every rank has the same ``values`` (collective).

        Every rank raises the same :class:`RankMismatch`, naming the first differing setting.
        """
        gathered: list[Any] = [None] * self.world_size
        local = dict(values)
        self.run("start-up check", lambda: dist.all_gather_object(gathered, local))
        reference = gathered[0]
        for rank, other in enumerate(gathered[1:], start=1):
            differing = [
                f"{key} (rank 0: {reference[key]!r}, rank {rank}: {other.get(key)!r})"
                for key in reference
                if other.get(key) != reference[key]
            ]
            if differing:
                raise RankMismatch(
                    f"ranks disagree on {'; '.join(differing)}. Every rank must call make_private "
                    "with the same whole dataset, batch size, ε or σ, clip norm, steps, δ and "
                    "model; nothing was started"
                )

    def broadcast_model(self, model: nn.Module) -> None:
        """Start every rank from rank 0's parameters and buffers (the initialisation is public)."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                self.run("broadcast of the initial model", lambda t=tensor: _broadcast(t))

    prepare = SingleProcess.prepare
    model_state = SingleProcess.model_state
    load_model_state = SingleProcess.load_model_state
    optimizer_state = SingleProcess.optimizer_state
    load_optimizer_state = SingleProcess.load_optimizer_state

    def verify_ledger(self, ledger: Any) -> None:
        """Raise unless every rank's ledger accounts the same events (true by construction).

        The realised-batch-size diagnostics (``examples_seen``) are local to each rank and left
        out: they take no part in accounting.
        """
        state = {k: v for k, v in ledger.state_dict().items() if k in _ACCOUNTED}
        gathered: list[Any] = [None] * self.world_size
        self.run("ledger check", lambda: dist.all_gather_object(gathered, state))
        for rank, other in enumerate(gathered):
            if other != gathered[0]:
                raise RanksOutOfStep(
                    f"the ledgers of rank 0 and rank {rank} differ ({gathered[0]} vs {other}); "
                    "the ranks did not take the same steps — do not publish this run's ε"
                )


class AllReduceAggregator:
    """Σ over ranks of (local clipped sum + N(0, std²/W)) by one all-reduce per dtype/device."""

    def __init__(self, replicas: ProcessGroupReplicas) -> None:
        self.replicas = replicas
        self.sequence = 0  # logical batches this rank has finished (aggregated or skipped)

    def share_std(self, std: float) -> float:
        """std/√W: W independent shares add up to variance std²."""
        return std / math.sqrt(self.replicas.world_size)

    def combine(self, noised: dict[str, Tensor]) -> dict[str, Tensor]:
        """The noisy global clipped sum, identical on every rank; nothing changes on failure."""
        self._check_in_step()
        total = self._all_reduced(noised)
        self.sequence += 1
        return total

    def _all_reduced(self, noised: dict[str, Tensor]) -> dict[str, Tensor]:
        """Σ over ranks of each tensor, by one all-reduce per dtype and device."""
        noised = dict(noised)
        for group in _by_dtype_and_device(noised).values():
            flat = torch.cat([noised[name].reshape(-1) for name in group])
            self.replicas.run("all-reduce of the clipped sums", lambda f=flat: _all_reduce(f))
            offset = 0
            for name in group:
                size = noised[name].numel()
                noised[name] = flat[offset : offset + size].view_as(noised[name])
                offset += size
        return noised

    def skip(self) -> None:
        """Count the abandoned batch, so the next collective notices ranks out of step."""
        self.sequence += 1

    def _check_in_step(self) -> None:
        """Σ s and Σ s² over ranks equal W·s and W·s² only if every rank is at step s."""
        s = float(self.sequence)
        world = self.replicas.world_size
        control = torch.tensor([s, s * s], dtype=torch.float64, device=self.replicas._device)
        self.replicas.run("step check", lambda: _all_reduce(control))
        if control[0].item() != world * s or control[1].item() != world * s * s:
            raise RanksOutOfStep(
                f"rank {self.replicas.rank} is at logical batch {self.sequence} but the ranks are "
                "not all there (one skipped a step after an error, or ran a different number of "
                "batches); distributed DP-SGD needs every rank to take every step. Nothing was "
                "applied; stop every rank and resume from the last checkpoint"
            )


class ShardedReplicas(ProcessGroupReplicas):
    """The ranks of a ``fully_shard`` (FSDP2) model: parameters and optimizer state sharded.

    Each example is on one rank and its layers run on the all-gathered parameters, so its
    gradient — and its norm — is computed whole on that rank, exactly as in one process; the
    clipped sums (each rank's noise share included) are summed over the ranks and each rank
    keeps its own shard as the parameter's gradient, which the wrapped optimizer applies to its
    shard. Checkpoints hold the full model and optimizer state (gathered, written by rank 0) and
    load back into any sharding of the same model over the same number of ranks.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._params = dict(model.named_parameters())

    def aggregator(self) -> GradientAggregator:
        """Reduce-scatter of the noised clipped sums: this rank's shard of each."""
        return ShardedAggregator(self, self._params)

    def prepare(self, engine: Any, behaviour: Any) -> None:
        """Refuse an engine that re-runs layers; stop the model probe (it would hang).

        Re-running a layer outside the model's own forward pass (the vmap engine) would use its
        sharded parameters, and the model probe's re-run of the whole model on one rank would
        wait for parameter gathers the other ranks, probing their own batches or none, never
        join.
        """
        if engine.kind != "fast":
            reason = f" ({engine.fallback_reason})" if engine.fallback_reason else ""
            raise ValueError(
                "a model sharded with fully_shard trains with the fast engine only (the vmap "
                f"engine re-runs layers on their sharded parameters){reason}; pass "
                "engine='fast' with layers that have fast rules, or train the model unsharded"
            )
        if behaviour is not None:
            behaviour.model.remove()
            behaviour.model.tally.skip(
                "the model is sharded (FSDP2): re-running it on one rank would wait on the "
                "other ranks' parameter gathers, so it was not probed; probe it unsharded in "
                "one process (a short run without fully_shard) before training it sharded"
            )

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The full (unsharded) state dict, on the CPU (collective; rank 0's is the one written)."""
        return get_model_state_dict(model, options=_FULL)

    def load_model_state(self, model: nn.Module, state: Mapping[str, Any]) -> None:
        """Load a full state dict into the sharded model: each rank keeps its own shards."""
        set_model_state_dict(model, dict(state), options=_FULL_LOAD)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The wrapped optimizer's full state (collective)."""
        return get_optimizer_state_dict(model, optimizer, options=_FULL)

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any
    ) -> None:
        """Load a full optimizer state into this rank's shards."""
        set_optimizer_state_dict(model, optimizer, state, options=_FULL_LOAD)


class ShardedAggregator(AllReduceAggregator):
    """Σ over ranks of (clipped sum + N(0, std²/W)), each rank receiving only its own shard.

    The sums are formed full-size on every rank (each rank's examples touch every coordinate).
    Parameters sharded on dim 0 over the ranks (``fully_shard``'s layout) are summed by one
    reduce-scatter per dtype and device: rank r receives the sum of rows r·c … (r+1)·c − 1 of
    every such parameter (c = ⌈rows / W⌉, as ``torch.chunk`` cuts), half the traffic of an
    all-reduce on two ranks. Any other parameter (replicated, or sharded otherwise) is
    all-reduced whole and then cut like the parameter. Each result is a DTensor laid out like
    its parameter, which the optimizer then updates.
    """

    def __init__(self, replicas: ShardedReplicas, params: Mapping[str, Tensor]) -> None:
        super().__init__(replicas)
        self.params = params

    def combine(self, noised: dict[str, Tensor]) -> dict[str, Tensor]:
        """The noisy global clipped sum of this rank's shard of every parameter."""
        rows = {name: t for name, t in noised.items() if _row_sharded(self.params.get(name))}
        rest = {name: t for name, t in noised.items() if name not in rows}
        self._check_in_step()
        out: dict[str, Tensor] = {}
        for group in _by_dtype_and_device(rows).values():
            out.update(self._scattered({name: rows[name] for name in group}))
        for name, total in self._all_reduced(rest).items():
            out[name] = _shard_like(self.params.get(name), total)
        self.sequence += 1
        return {name: out[name] for name in noised}

    def _scattered(self, sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's rows of Σ over ranks of ``sums`` (one dtype and device), as DTensors."""
        world = self.replicas.world_size
        chunks = {name: -(-t.shape[0] // world) for name, t in sums.items()}  # ⌈rows / W⌉
        pieces = []
        for r in range(world):
            for name, total in sums.items():
                c = chunks[name]
                part = total[r * c : (r + 1) * c].reshape(-1)
                pad = c * total[0].numel() - part.numel()
                pieces.append(part if pad == 0 else torch.cat([part, part.new_zeros(pad)]))
        flat = torch.cat(pieces)
        mine = flat.new_empty(flat.numel() // world)
        self.replicas.run("reduce-scatter of the clipped sums", lambda: _reduce_scatter(mine, flat))
        out, offset = {}, 0
        for name, total in sums.items():
            param = self.params[name]
            local = param.to_local()  # type: ignore[attr-defined]
            size = chunks[name] * total[0].numel()
            shard = mine[offset : offset + local.numel()].view(local.shape)
            offset += size
            out[name] = DTensor.from_local(
                shard, param.device_mesh, param.placements,  # type: ignore[attr-defined]
                shape=param.shape, stride=param.stride(),
            )  # fmt: skip
        return out


def _row_sharded(param: Tensor | None) -> bool:
    """Sharded on dim 0 over a 1-D mesh (``fully_shard``'s layout) and at least 1-D."""
    if not isinstance(param, DTensor) or param.dim() == 0 or param.device_mesh.ndim != 1:
        return False
    (placement,) = param.placements
    return placement.is_shard() and placement.dim == 0  # type: ignore[attr-defined]


def _reduce_scatter(output: Tensor, flat: Tensor) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = scatter(output, flat, op=dist.ReduceOp.SUM)
    if work is not None:
        work.wait()


def _shard_like(param: Tensor | None, full: Tensor) -> Tensor:
    """``full`` cut as ``param`` is sharded (a plain parameter: ``full`` itself)."""
    if not isinstance(param, DTensor):
        return full
    local = full
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if placement.is_shard():
            axis = placement.dim  # type: ignore[attr-defined]
            pieces = torch.chunk(local, mesh.size(dim), dim=axis)
            index = mesh.get_local_rank(dim)
            local = pieces[index] if index < len(pieces) else local.narrow(axis, 0, 0)
    expected = param.to_local().shape
    if local.shape != expected:
        raise ValueError(
            f"a sharded parameter's local shard has shape {tuple(expected)} but its part of the "
            f"gradient has {tuple(local.shape)}: only fully_shard's even dim-0 sharding is "
            "supported; shard the model with torch.distributed.fsdp.fully_shard defaults"
        )
    return DTensor.from_local(
        local.contiguous(), mesh, param.placements, shape=param.shape, stride=param.stride()
    )


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_LOAD = StateDictOptions(full_state_dict=True)


def _all_reduce(tensor: Tensor) -> None:
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    if work is not None:
        work.wait()


def _broadcast(tensor: Tensor) -> None:
    """Rank 0's values everywhere; a sharded tensor (FSDP2) is one tensor already.

    Each rank owns its own shard of a ``fully_shard`` parameter, so the ranks hold one model
    whatever each initialised; a replicated DTensor's local copy is broadcast like a tensor.
    """
    local = _local(tensor)
    if local is None:
        return
    dist.broadcast(local, src=0)


def _local(tensor: Tensor) -> Tensor | None:
    """The plain tensor a broadcast may overwrite: None for a sharded DTensor."""
    if isinstance(tensor, DTensor):
        if any(p.is_shard() for p in tensor.placements):
            return None
        return tensor.to_local()
    return tensor.data


def _by_dtype_and_device(tensors: dict[str, Tensor]) -> dict[tuple[Any, Any], list[str]]:
    """Names grouped so each group can be flattened into one buffer."""
    groups: dict[tuple[Any, Any], list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault((tensor.dtype, tensor.device), []).append(name)
    return groups


def _collective_device() -> torch.device:
    """Where small control tensors live: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def replicas_for(
    distributed: bool | None, model: nn.Module
) -> SingleProcess | ProcessGroupReplicas:
    """Pick one process, the process group, or its sharded form for a ``fully_shard`` model.

    ``None``: distributed when a process group with more than one rank is initialised. A
    sharded model needs the process group it was sharded over.
    """
    if distributed not in (None, True, False):
        raise ValueError(f"distributed must be None, True or False; got {distributed!r}")
    sharded = is_sharded(model)
    if sharded and distributed is False:
        raise ValueError(
            "the model is sharded with fully_shard (FSDP2), so its parameters live on every "
            "rank of the process group; leave distributed=None (or True) to train it with them"
        )
    if distributed is None:
        replicas = current_replicas()
    else:
        replicas = ProcessGroupReplicas() if distributed else SingleProcess()
    if sharded and isinstance(replicas, ProcessGroupReplicas):
        return ShardedReplicas(model)
    return replicas


def current_replicas() -> SingleProcess | ProcessGroupReplicas:
    """The process group if one of more than one rank is initialised, else one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProcessGroupReplicas()
    return SingleProcess()


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) sharded some of the model's parameters (DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The model inside a ``DistributedDataParallel`` wrapper, the wrapper's own sync off.

    DDP would average *unclipped* gradients across ranks in its backward hooks; dpfy sums the
    clipped, noised ones itself. Turning the wrapper's gradient sync off (as its ``no_sync()``
    does) leaves calling it a plain forward, so a loop or framework that calls the wrapper
    (Lightning's DDP strategy) trains the same private model. A plain model is returned as is.
    """
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    model.require_backward_grad_sync = False
    return model.module


@contextlib.contextmanager
def launched_process_group(
    backend: str = "gloo", timeout: datetime.timedelta = datetime.timedelta(minutes=10)
) -> Iterator[None]:
    """Join the process group a launcher such as torchrun describes, for the block's duration.

    Does nothing unless ``WORLD_SIZE`` > 1 and no group is initialised yet (a user's script that
    set up its own group keeps it). ``timeout`` bounds how long ranks wait for a stopped peer.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield
        return
    dist.init_process_group(backend, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trainable_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Names and shapes of the trainable parameters, for the start-up agreement check."""
    return {name: list(p.shape) for name, p in model.named_parameters() if p.requires_grad}
