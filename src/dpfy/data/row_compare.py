"""Rows of collated structures: pick them, and say where two of them differ beyond float noise.

The independence probes compare what an example produced inside its batch with what it produced
with the rest of the batch changed (or alone); batches are tensors or containers of them
(dicts, tuples, namedtuples, lists of per-example items), batch-first unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from dpfy.data.batches import holds_batches

#: Relative tolerance, in units of the dtype's epsilon, of a row compared with itself recomputed
#: in another batch: the same kernels on the same shapes agree to a few ulps, and a coupling that
#: matters for clipping moves rows by orders of magnitude more.
_ULPS = 256
_FLOOR = 1e-5
#: ...but never looser than this share of the scale, whatever the precision: 256 ulps of
#: bfloat16 would be 2× the value itself, and a coupling would pass unseen.
_CEILING = 0.02


def map_rows(tree: Any, size: int, rows_of: Callable[[Any], Any], dim: int = 0) -> Any:
    """Apply ``rows_of`` to every leaf that holds ``size`` examples along ``dim``; keep the rest.

    Tensors whose ``dim`` is not ``size`` (a shared mask, a scalar) are left as they are, like
    anything that is not a tensor or a list of per-example items.
    """
    if isinstance(tree, torch.Tensor):
        return rows_of(tree) if tree.dim() > dim and tree.shape[dim] == size else tree
    if isinstance(tree, Mapping):
        mapped = {k: map_rows(v, size, rows_of, dim) for k, v in tree.items()}
        try:
            return type(tree)(mapped)
        except TypeError:  # a mapping that cannot be built from a dict: its contents will do
            return mapped
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_rows(v, size, rows_of, dim) for v in tree))
    if isinstance(tree, list) and not holds_batches(tree):
        return rows_of(tree) if len(tree) == size and dim == 0 else tree
    if isinstance(tree, Sequence) and not isinstance(tree, (str, bytes)):
        return type(tree)(map_rows(v, size, rows_of, dim) for v in tree)
    return tree


def take_rows(tree: Any, size: int, index: torch.Tensor, dim: int = 0) -> Any:
    """The rows ``index`` (any length, repeats allowed) of every leaf holding ``size`` rows."""
    positions = index.tolist()

    def pick(rows: Any) -> Any:
        if isinstance(rows, torch.Tensor):
            return rows.index_select(dim, index.to(rows.device))
        return [rows[i] for i in positions]

    return map_rows(tree, size, pick, dim)


def batch_rows(tree: Any, size: int, index: torch.Tensor, dim: int = 0) -> list[torch.Tensor]:
    """The rows ``index`` of every tensor leaf holding ``size`` rows; other leaves are dropped.

    What is compared when only per-example values matter (a model's batch-mean loss is not).
    """
    return [
        leaf.index_select(dim, index.to(leaf.device))
        for _, leaf in leaves(tree)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == size
    ]


def leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    """Every leaf with its path (``[0]``, ``['input_ids']``…), in a fixed order."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            for path, leaf in leaves(value):
                yield f"[{key!r}]{path}", leaf
    elif isinstance(tree, (list, tuple)) and not (
        isinstance(tree, list) and not holds_batches(tree)
    ):
        for i, value in enumerate(tree):
            for path, leaf in leaves(value):
                yield f"[{i}]{path}", leaf
    else:
        yield "", tree


def first_difference(expected: Any, seen: Any, *, crop: bool = False) -> str | None:
    """Where ``seen`` differs from ``expected`` beyond float noise (None: nowhere).

    With ``crop`` a tensor of ``expected`` may be larger than its counterpart in every dimension
    (a padding collate pads a batch to its longest example): only the overlap is compared,
    aligned at the start (right padding) or, failing that, at the end (left padding).
    """
    pairs_a, pairs_b = list(leaves(expected)), list(leaves(seen))
    if [p for p, _ in pairs_a] != [p for p, _ in pairs_b]:
        return "its structure changed"
    for (path, a), (_, b) in zip(pairs_a, pairs_b, strict=True):
        problem = _leaf_difference(a, b, crop)
        if problem is not None:
            return f"{path or 'the value'} {problem}"
    return None


def _leaf_difference(a: Any, b: Any, crop: bool) -> str | None:
    """How two leaves differ, or None."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if _plain_equal(a, b) else "differs"
    if crop and a.shape != b.shape and _covers(a, b):
        start = _leaf_difference(a[tuple(slice(0, n) for n in b.shape)], b, False)
        if start is None:
            return None
        end = a[tuple(slice(x - y, x) for x, y in zip(a.shape, b.shape, strict=True))]
        return None if _leaf_difference(end, b, False) is None else start
    if a.shape != b.shape:
        return f"has shape {tuple(b.shape)} instead of {tuple(a.shape)}"
    if not (a.is_floating_point() or a.is_complex()):
        return None if torch.equal(a, b.to(a.device)) else "differs"
    dtype = a.dtype if a.is_floating_point() else torch.float32
    a, b = a.detach().double(), b.detach().to(a.device).double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    scale = float(torch.where(finite, a.abs().maximum(b.abs()), 0.0).max()) if a.numel() else 0.0
    tol = min(_CEILING, max(_FLOOR, _ULPS * torch.finfo(dtype).eps))
    close = torch.isclose(a, b, rtol=0.0, atol=tol * max(scale, 1e-12), equal_nan=True)
    if bool(close.all()):
        return None
    worst = float(torch.where(finite, (a - b).abs(), torch.inf).max())
    return f"moved by {worst:.3g} (scale {scale:.3g})"


def _covers(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is at least as large as ``b`` in every one of the same dimensions."""
    return a.dim() == b.dim() and all(x >= y for x, y in zip(a.shape, b.shape, strict=True))


def _plain_equal(a: Any, b: Any) -> bool:
    """Equality of non-tensor leaves; arrays compare element-wise."""
    try:
        return bool(a == b) if not hasattr(a, "shape") else bool((a == b).all())
    except Exception:
        return a is b
