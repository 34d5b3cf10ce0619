"""The public API is documented: every name a package exports resolves and has a docstring, and
docs/api.md is the reference generated from them, up to date."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import api_reference  # noqa: E402


@pytest.mark.parametrize("package", api_reference.PACKAGES)
def test_every_exported_name_resolves_and_says_what_it_is(package):
    module = importlib.import_module(package)
    assert module.__all__ == sorted(set(module.__all__), key=module.__all__.index)  # no repeats
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{package}.{name} has no docstring"


def test_the_api_reference_is_generated_from_the_current_code():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "api_reference.py"), "--check"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_reference_documents_the_top_level_names():
    text = api_reference.reference()
    import dpfy

    for name in dpfy.__all__:
        if not name.startswith("__"):
            assert f"`{name}" in text, name
    assert "(no docstring)" not in text
