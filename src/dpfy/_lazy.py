"""Lazy package exports (PEP 562): a package names torch-backed objects without importing torch.

The planning stage and the command line must start without torch: each package's ``__init__``
maps its public names to their modules, and a module loads when one of its names is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a module path) on first use."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
