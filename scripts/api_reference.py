"""Write docs/api.md, the API reference, from the public names and their docstrings.

    .venv/bin/python scripts/api_reference.py          # rewrite docs/api.md
    .venv/bin/python scripts/api_reference.py --check  # exit 1 if docs/api.md is out of date

The public API is what each package's ``__all__`` lists; everything else may change without
notice. The reference is generated, never edited by hand, so it cannot drift from the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "docs" / "api.md"

#: The public packages, in the order of the guide's recipe.
PACKAGES = (
    "dpfy",
    "dpfy.plan",
    "dpfy.plan.accounting",
    "dpfy.data",
    "dpfy.train.grads",
    "dpfy.tune",
    "dpfy.federated",
    "dpfy.report",
)

HEADER = """# dpfy API reference

Generated from the docstrings by `scripts/api_reference.py`; do not edit by hand. The public API
is what each package's `__all__` lists (below); other modules may change without notice.
"""


def signature(obj: Any) -> str:
    """``(a, b=1)`` for a callable, or empty where Python cannot tell."""
    try:
        return without_addresses(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return ""


def without_addresses(text: str) -> str:
    """``<function f at 0x7f…>`` → ``<function f>``: the reference must not change run to run."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def docstring(obj: Any) -> str:
    """The cleaned docstring, or a note that there is none (a test refuses that)."""
    return inspect.getdoc(obj) or "(no docstring)"


def public_methods(cls: type) -> list[tuple[str, Any]]:
    """A class's own public methods and properties, in definition order."""
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property) or inspect.isfunction(value):
            members.append((name, value))
        elif isinstance(value, (classmethod, staticmethod)):
            members.append((name, value.__func__))
    return members


def describe(name: str, obj: Any) -> list[str]:
    """One entry: a heading with the signature, the docstring, and a class's members."""
    if inspect.isclass(obj):
        lines = [f"### class `{name}{signature(obj)}`", "", docstring(obj), ""]
        for member, value in public_methods(obj):
            if isinstance(value, property):
                lines += [f"- **`{member}`** (property): {first_line(value)}"]
            else:
                lines += [f"- **`{member}{signature(value)}`**: {first_line(value)}"]
        return [*lines, ""] if lines[-1] else lines
    if typing.get_origin(obj) is not None:  # a type alias such as Literal["fast", "vmap"]
        return [f"### type `{name}`", "", f"`{short_repr(obj)}`", ""]
    if callable(obj):
        return [f"### `{name}{signature(obj)}`", "", docstring(obj), ""]
    return [f"### `{name}`", "", f"`{short_repr(obj)}`", ""]


def first_line(obj: Any) -> str:
    """The docstring's first paragraph, on one line."""
    return " ".join(docstring(obj).split("\n\n")[0].split())


def short_repr(value: Any) -> str:
    """A constant's value, cut to one readable line."""
    text = without_addresses(" ".join(repr(value).split()))
    return text if len(text) <= 200 else text[:197] + "..."


def reference() -> str:
    """The whole reference, package by package."""
    lines = [HEADER]
    for package in PACKAGES:
        module = importlib.import_module(package)
        lines += [f"## `{package}`", "", docstring(module), ""]
        for name in module.__all__:
            if name.startswith("__"):
                continue
            lines += describe(name, getattr(module, name))
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    """Write or check docs/api.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md is stale")
    args = parser.parse_args()
    text = reference()
    if args.check:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run `python scripts/api_reference.py`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
