"""The lazy public face: every name in ``distcompat.__all__`` resolves, and a bare import is cheap.

``import distcompat`` imports no subpackage (and so not torch); each public name is imported on
first access through ``distcompat.__getattr__``. ``distcompat.init_distributed`` imports the
process-group lifecycle but not the collectives and diagnostics, which its first call imports
and wires in. Import checks run in a fresh interpreter so ``sys.modules`` holds only what the
import itself brought in.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import distcompat
from _rank_processes import run_ranks

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

#: Not imported by reaching ``init_distributed``: the collectives face (shm, agree, direct), the
#: diagnostics that watch it, and rank_logging (which imports the diagnostics). Its first call
#: imports them (issue 28: reaching it costs within 1.05x of ``import torch``).
DEFERRED = ("distcompat.collectives", "distcompat.diagnostics", "distcompat.rank_logging")


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


@pytest.mark.slow
def test_every_public_name_resolves() -> None:
    missing = _fresh(
        "import json, distcompat; "
        "print(json.dumps([n for n in distcompat.__all__ if not hasattr(distcompat, n)]))"
    )
    assert missing == []
    for name in distcompat.__all__:
        assert getattr(distcompat, name) is not None, name


@pytest.mark.slow
def test_from_import_and_first_call_work() -> None:
    assert _fresh(
        "import json; from distcompat import init_distributed, LaunchEnv, attend; "
        "import distcompat; "
        "print(json.dumps(distcompat.init_distributed is init_distributed "
        "and callable(distcompat.get_rank)))"
    )


@pytest.mark.slow
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


@pytest.mark.slow
def test_init_distributed_is_reached_without_the_collectives() -> None:
    loaded = _fresh(
        "import json, sys, distcompat, distcompat.process_group; distcompat.init_distributed; "
        f"print(json.dumps([m for m in ('torch', *{DEFERRED!r}) if m in sys.modules]))"
    )
    assert loaded == ["torch"]


#: A rank that reaches init_distributed in a fresh interpreter, makes its first group and returns
#: with the group up. It prints what was imported before init and what init wired in.
FIRST_GROUP = f"""
import json, sys
import torch
import distcompat

distcompat.init_distributed
before = [m for m in {DEFERRED!r} if m in sys.modules]
info = distcompat.init_distributed(device="cpu")
from distcompat.collectives import _checked
from distcompat.diagnostics import _exit
from distcompat.process_group import _lifecycle

started = _lifecycle._current.watchdog
value = torch.ones(2)
distcompat.all_reduce(value)
print(json.dumps({{
    "before": before,
    "watchdog hooked": started is not None and _checked.watch is started,
    "exit guard": sys.excepthook is _exit._excepthook,
    "teardown at exit": _lifecycle._exit_registered,
    "sum": value.sum().item(),
}}))
"""


@pytest.mark.slow
def test_the_first_init_wires_in_what_it_no_longer_imports(tmp_path: Path) -> None:
    """Two fresh ranks: init's first call starts the watchdog, the exit guard and the teardown."""
    script = tmp_path / "first_group.py"
    script.write_text(FIRST_GROUP)
    ranks = run_ranks(script, 2, timeout=120)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr
        assert json.loads(rank.stdout.strip().splitlines()[-1]) == {
            "before": [],
            "watchdog hooked": True,
            "exit guard": True,
            "teardown at exit": True,
            "sum": 4.0,
        }
