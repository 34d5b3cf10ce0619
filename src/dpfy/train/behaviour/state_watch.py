"""Nothing changes the model outside the private step: a fingerprint of every parameter and buffer.

Writes through ``.data`` (``buf.data.mul_(…)``, ``buf.data = …``, ``param.data.add_(…)``) bypass
autograd's version counters, and a training loop may write a batch statistic into a buffer
between steps: either way the saved model then holds un-noised statistics of private batches.
The fingerprint — each tensor's L2 norm and sum, in float32 at least — is taken after each
private update and compared before the next one changes anything; buffers the user declares
public, and spectral normalisation's power-iteration vectors (which follow the weights, not the
data), are left out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from dpfy.data.provenance import BatchRefused
from dpfy.train.grads.engine import power_iteration_buffers


class StateChanged(BatchRefused):
    """A parameter or buffer changed outside the private step; the step was not applied."""


class StateWatch:
    """The model's parameters and buffers as the last private step left them."""

    def __init__(self, model: nn.Module, public_buffers: Iterable[str] = ()) -> None:
        self.model = model
        self.public = _checked_public(model, public_buffers)
        self._exempt = power_iteration_buffers(model)
        # Each module's own parameter and buffer dicts: nn.Module makes them once and assigning,
        # registering or loading changes their entries, never the dicts, so reading them afresh
        # sees every tensor as it is now without walking the module tree each step.
        self._dicts = [
            (f"{prefix}." if prefix else "", tensors)
            for prefix, module in model.named_modules(remove_duplicate=True)
            for tensors in (module._parameters, module._buffers)
        ]
        self._seen: dict[str, tuple[object, ...]] = {}
        self.checks = 0

    def record(self) -> None:
        """Take the fingerprint of the state as it is now (after make_private, a step, a load)."""
        self._seen = self._fingerprint()

    def check(self) -> None:
        """Refuse if anything watched differs from the last fingerprint; changes nothing."""
        now = self._fingerprint()
        self.checks += 1
        changed = [
            name
            for name in sorted(set(now) | set(self._seen))
            if now.get(name) != self._seen.get(name)
        ]
        if changed:
            listed = ", ".join(f"'{name}'" for name in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise StateChanged(
                f"{listed}{more} changed outside the private step (a write in the forward pass, "
                "e.g. through .data, or in the loop between steps): a statistic of private data "
                "would reach the model without clipping or noise. Nothing was applied. Fix: keep "
                "such statistics out of the model (compute them on public data), or pass "
                "public_buffers=[...] to make_private for a buffer whose value is public; reload "
                "the last checkpoint to go on"
            )

    def _fingerprint(self) -> dict[str, tuple[object, ...]]:
        """Name → (shape, dtype, L2 norm, sum) of every watched tensor; one host read in all."""
        seen: set[int] = set()
        named = []
        for prefix, tensors in self._dicts:
            for local, tensor in tensors.items():
                name = prefix + local
                if tensor is None or id(tensor) in seen or id(tensor) in self._exempt:
                    continue
                seen.add(id(tensor))
                if name not in self.public:
                    named.append((name, tensor))
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in named:
            by_device.setdefault(tensor.device, []).append((name, tensor))
        found: dict[str, tuple[object, ...]] = {}
        for group in by_device.values():  # one device-to-host copy per device
            values = _summaries([_local(t.detach()) for _, t in group]).cpu().tolist()
            for (name, tensor), row in zip(group, values, strict=True):
                found[name] = (
                    tuple(tensor.shape),
                    tensor.dtype,
                    *(x if x == x else "nan" for x in row),
                )
        return found


def _summaries(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(L2 norm, sum) of each tensor, accumulated wide (float64 on the CPU), one row each.

    The norms of all floating tensors come from one fused call (per-tensor calls cost more than
    the reading on small models); the sums are one reduction each, stacked once.
    """
    wide = torch.float64 if tensors[0].device.type == "cpu" else torch.float32
    real = [_real(t, wide) for t in tensors]
    try:
        norms = list(torch._foreach_norm(real, 2, dtype=wide))
    except (TypeError, RuntimeError):  # torch without the dtype argument: one call each
        norms = [torch.linalg.vector_norm(t, dtype=wide) for t in real]
    sums = [t.sum(dtype=wide) for t in real]
    return torch.stack([torch.stack(norms), torch.stack(sums)], dim=1).double()


def _real(tensor: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """A floating view of any tensor: complex as pairs of reals, integers and bools widened."""
    if tensor.is_complex():
        return torch.view_as_real(tensor)
    return tensor if tensor.is_floating_point() else tensor.to(wide)


def _checked_public(model: nn.Module, names: Iterable[str]) -> frozenset[str]:
    """The declared public buffers, each one a buffer of the model."""
    if isinstance(names, str):
        raise ValueError("public_buffers must be a list of buffer names, not one string")
    buffers = {name for name, _ in model.named_buffers()}
    public = frozenset(names)
    for name in sorted(public):
        if name not in buffers:
            known = ", ".join(sorted(buffers)[:8]) or "none"
            raise ValueError(
                f"public_buffers: the model has no buffer '{name}' (its buffers: {known}); "
                "name buffers as model.named_buffers() does. Parameters are always private"
            )
    return public


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2 DTensor) tensor; a plain tensor as is.

    Each rank fingerprints its own shard, so a write to any shard refuses on the rank holding it.
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
