"""Option choices built from the registries' names, shared by the commands."""

from __future__ import annotations

from enum import Enum

__all__ = ["choices"]


def choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum of a registry's names, so the parser lists them and refuses a typo by name."""
    return Enum(name, {value.replace("-", "_"): value for value in values}, type=str)
