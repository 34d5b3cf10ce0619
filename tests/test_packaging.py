"""What the installed package says about itself: typed, licensed (SPDX), versioned."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import dpfy


def test_the_package_ships_its_type_information():
    assert (Path(dpfy.__file__).parent / "py.typed").is_file()


def test_the_license_is_an_spdx_expression_with_its_file():
    metadata = importlib.metadata.metadata("dpfy")
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (metadata.get_all("License-File") or [])
    root = Path(dpfy.__file__).parents[2]
    if (root / "pyproject.toml").is_file():  # a source checkout
        assert "Apache License" in (root / "LICENSE").read_text()


def test_dpfy_version_prints_the_installed_version():
    done = subprocess.run(
        [sys.executable, "-m", "dpfy", "--version"], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == f"dpfy {dpfy.__version__}"
    assert importlib.metadata.version("dpfy") == dpfy.__version__


def test_no_text_cites_a_design_document_users_do_not_have():
    # Docstrings, messages and report sentences state the rule itself (users have no DESIGN.md).
    source = Path(dpfy.__file__).parent
    citing = [
        str(path.relative_to(source))
        for path in source.rglob("*.py")
        if "DESIGN" in path.read_text() or " (rule " in path.read_text()
    ]
    assert citing == []
