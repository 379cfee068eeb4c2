"""One version: _version.py, distcompat.__version__, `distcompat --version`, the metadata."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import distcompat
from distcompat import _version
from distcompat.cli import main


def test_version_attribute_matches_installed_metadata() -> None:
    # A mismatch here means the installed metadata is stale: reinstall (pip install -e .).
    assert distcompat.__version__ == _version.__version__ == version("distcompat")


def test_cli_version_matches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"distcompat {version('distcompat')}\n"


@pytest.mark.slow
def test_console_module_version_matches() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "distcompat", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.split() == ["distcompat", version("distcompat")]


def test_version_module_imports_nothing() -> None:
    # setuptools reads __version__ from this file at build time, without importing distcompat.
    tree = ast.parse(Path(_version.__file__).read_text(encoding="utf-8"))
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
