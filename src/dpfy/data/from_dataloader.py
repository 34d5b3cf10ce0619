"""A torch ``DataLoader`` where a private run expects a dataset, as Opacus users pass one.

The run keeps what describes *how examples are loaded* (the dataset, ``collate_fn``, workers,
pinning, the generator that seeds worker processes) and replaces what decides *which examples
form a batch* (its sampler, ``shuffle``, ``drop_last``): batches are Poisson-sampled at
q = B/N, the only sampling the accounting describes (guide §4.3). Its ``batch_size`` becomes
the *expected* batch size B.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, Dataset, default_collate, default_convert

__all__ = ["unpack_dataloader"]

# DataLoader attributes that describe loading, with the value that means "not set".
_LOADING = {
    "num_workers": 0,
    "pin_memory": False,
    "timeout": 0,
    "worker_init_fn": None,
    "multiprocessing_context": None,
    "persistent_workers": False,
    "pin_memory_device": "",
}


def unpack_dataloader(
    data: Dataset | DataLoader, batch_size: int | None, options: dict[str, Any]
) -> tuple[Dataset, int, dict[str, Any]]:
    """The dataset, expected batch size B and loader options a private run draws with.

    A plain dataset needs ``batch_size``. A DataLoader gives its own: passing both is refused
    when they differ, since one of them would be silently ignored.
    """
    if not isinstance(data, DataLoader):
        if batch_size is None:
            raise ValueError(
                "batch_size is required: pass the expected batch size B (q = B/N), or pass a "
                "DataLoader whose batch_size is B"
            )
        return data, batch_size, options
    if hasattr(data, "provenance"):
        raise ValueError(
            "this loader is already a private loader; pass its dataset (loader.dataset) to "
            "build another private run"
        )
    return data.dataset, _expected_batch_size(data, batch_size), _merged(data, options)


def _expected_batch_size(loader: DataLoader, batch_size: int | None) -> int:
    """B from the DataLoader (its ``batch_size``), or from ``batch_size`` when they agree."""
    own = loader.batch_size
    if own is None and batch_size is None:
        raise ValueError(
            "the DataLoader draws batches with its own batch_sampler, so it states no batch size; "
            "pass batch_size= (the expected batch size B) to make_private"
        )
    if own is not None and batch_size is not None and own != batch_size:
        raise ValueError(
            f"batch_size={batch_size} and the DataLoader's batch_size={own} disagree; the private "
            "run samples batches of expected size B itself (Poisson, q = B/N). Pass one of them "
            "(the DataLoader's batch_size is used when batch_size is omitted)"
        )
    return int(own if batch_size is None else batch_size)


def _merged(loader: DataLoader, options: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader's loading settings, with any the caller also passes required to agree."""
    taken: dict[str, Any] = {
        name: getattr(loader, name)
        for name, unset in _LOADING.items()
        if getattr(loader, name, unset) != unset
    }
    if loader.collate_fn not in (default_collate, default_convert):  # not torch's automatic one
        taken["collate_fn"] = loader.collate_fn
    if loader.num_workers > 0 and loader.prefetch_factor is not None:
        taken["prefetch_factor"] = loader.prefetch_factor
    if loader.generator is not None:
        taken["worker_generator"] = loader.generator
    clashes = sorted(k for k in set(taken) & set(options) if options[k] is not taken[k])
    if clashes:
        raise ValueError(
            f"loader_options set {', '.join(clashes)}, which the DataLoader passed in sets too; "
            "set them in one place"
        )
    return {**taken, **options}
