"""The lazy public face: every name in ``distcompat.__all__`` resolves, and a bare import is cheap.

``import distcompat`` imports no subpackage (and so not torch); each public name is imported on
first access through ``distcompat.__getattr__``. Import checks run in a fresh interpreter so
``sys.modules`` holds only what the import itself brought in.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import distcompat

FACE = Path(distcompat.__file__)

#: Imported by nothing but a first use: the subpackages and torch itself.
HEAVY = (
    "torch",
    "distcompat.attention",
    "distcompat.checkpoint",
    "distcompat.collectives",
    "distcompat.data",
    "distcompat.diagnostics",
    "distcompat.join",
    "distcompat.launch",
    "distcompat.process_group",
    "distcompat.rank_logging",
)


def _fresh(code: str) -> object:
    """Run ``code`` in a new interpreter and return the JSON it prints last."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_bare_import_pulls_in_no_subpackage() -> None:
    loaded = _fresh(
        "import json, sys, distcompat; "
        f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
    )
    assert loaded == []


def test_every_public_name_resolves() -> None:
    missing = _fresh(
        "import json, distcompat; "
        "print(json.dumps([n for n in distcompat.__all__ if not hasattr(distcompat, n)]))"
    )
    assert missing == []
    for name in distcompat.__all__:
        assert getattr(distcompat, name) is not None, name


def test_from_import_and_first_call_work() -> None:
    assert _fresh(
        "import json; from distcompat import init_distributed, LaunchEnv, attend; "
        "import distcompat; "
        "print(json.dumps(distcompat.init_distributed is init_distributed "
        "and callable(distcompat.get_rank)))"
    )


def test_subpackages_reachable_as_attributes() -> None:
    assert _fresh("import json, distcompat; print(json.dumps(distcompat.launch.__name__))") == (
        "distcompat.launch"
    )


def test_unknown_name_is_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        distcompat.no_such_name  # noqa: B018


def test_dir_lists_every_public_name() -> None:
    assert set(distcompat.__all__) <= set(dir(distcompat))


def test_table_imports_and_all_agree() -> None:
    """``_EXPORTS``, the ``TYPE_CHECKING`` imports and ``__all__`` name the same things."""
    typed: dict[str, str] = {}
    for node in ast.walk(ast.parse(FACE.read_text())):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                assert stmt.module is not None
                typed.update({alias.name: stmt.module for alias in stmt.names})
    exports = distcompat._EXPORTS
    assert typed == exports
    assert set(exports) | {"__version__"} == set(distcompat.__all__)
