"""The package imports only downward: no import cycle, no import against the layer table.

Reads the source of every module under ``src/distcompat`` with ``ast`` (nothing is imported), takes
every ``import`` of a distcompat module, at module level, under ``TYPE_CHECKING`` and inside
functions, and checks three rules:

* the module graph has no cycle;
* each import goes to the same unit (a subpackage or top-level module) or to a lower layer of
  :data:`LAYERS`, which docs/architecture.md shows as a table;
* an import inside a function carries a comment saying why it is late (an optional or heavy
  dependency): a late import must never be a way round a cycle.

Every failure names the import as ``file:line``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "distcompat"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

#: Bottom to top. A unit is a subpackage or a top-level module of distcompat ("distcompat" is the
#: package's own ``__init__``, the public face). A unit may import itself and lower layers only.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("_files", "_command", "_version", "_extras", "_scarcity", "_store")),
    ("launch", ("launch",)),
    ("ranks", ("_ranks", "env")),
    ("peers", ("peers",)),
    ("collectives", ("collectives",)),
    ("helpers", ("diagnostics", "checkpoint", "data", "join", "attention", "anysize")),
    ("logging", ("rank_logging",)),
    ("lifecycle", ("process_group",)),
    ("entry points", ("runtime", "testing", "distributed", "preemption", "run")),
    ("public face", ("distcompat",)),
    ("commands", ("demo", "bench")),
    ("command line", ("cli",)),
    ("python -m", ("__main__",)),
]
LAYER_OF = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


@dataclass(frozen=True, slots=True)
class Import:
    """One import of a distcompat module, where it is written."""

    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    path: Path
    line: int
    in_function: bool
    commented: bool

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _nearest_module(name: str) -> str:
    """``distcompat.a.b.Name`` -> the module that defines it (``distcompat.a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".") if is_package else module.split(".")[:-1]
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join([*base, *([node.module] if node.module else [])])
        else:
            prefix = node.module or ""
        # `from pkg import sub` imports the submodule when one exists, else a name of pkg.
        names = [
            f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix
            for alias in node.names
        ]
    found = {_nearest_module(n) for n in names if n == "distcompat" or n.startswith("distcompat.")}
    return sorted(found)


def _has_reason(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's lines, or above its run of imports and blank lines."""
    end = node.end_lineno or node.lineno
    if any("#" in lines[i - 1] for i in range(node.lineno, end + 1)):
        return True
    index = node.lineno - 2
    while index >= 0:
        text = lines[index].strip()
        if text.startswith("#"):
            return True
        if text and not text.startswith(("import ", "from ")):
            return False
        if "#" in text:
            return True
        index -= 1
    return False


def _imports() -> Iterator[Import]:
    for module, path in sorted(MODULES.items()):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        late = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(function)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(module, path.name == "__init__.py", node):
                if target != module:
                    yield Import(
                        source=module,
                        target=target,
                        path=path,
                        line=node.lineno,
                        in_function=id(node) in late,
                        commented=_has_reason(lines, node),
                    )


IMPORTS = list(_imports())


def unit_of(module: str) -> str:
    """``distcompat.collectives._group`` -> ``collectives``; the package -> ``distcompat``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "distcompat"


def allowed(source: str, target: str) -> bool:
    """May module ``source`` import module ``target``: same unit, or a lower layer."""
    a, b = unit_of(source), unit_of(target)
    return a == b or LAYER_OF[b] < LAYER_OF[a]


def _cycle(imports: list[Import]) -> list[Import] | None:
    """One import cycle of the module graph, as the imports that close it, or None."""
    edges: dict[str, list[Import]] = {}
    for item in imports:
        edges.setdefault(item.source, []).append(item)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Import] = []

    def visit(module: str) -> list[Import] | None:
        state[module] = 1
        for item in edges.get(module, []):
            if state.get(item.target) == 1:
                start = next(i for i, step in enumerate(path) if step.source == item.target)
                return [*path[start:], item] if path else [item]
            if item.target not in state:
                path.append(item)
                found = visit(item.target)
                if found:
                    return found
                path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_reader_sees_the_package() -> None:
    """Guard the guard: the walk finds the modules and the imports that are known to exist."""
    assert len(MODULES) > 80
    pairs = {(item.source, item.target) for item in IMPORTS}
    assert ("distcompat.process_group._lifecycle", "distcompat.diagnostics") in pairs
    late = [item for item in IMPORTS if item.in_function]
    assert any(item.source == "distcompat.cli._main" for item in late)


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(module) for module in MODULES}
    missing = sorted(units - set(LAYER_OF))
    assert not missing, f"add these to LAYERS (tests/test_architecture.py) and the doc: {missing}"
    assert not sorted(set(LAYER_OF) - units), "LAYERS names a unit that no longer exists"


def test_no_import_cycle() -> None:
    cycle = _cycle(IMPORTS)
    assert cycle is None, "import cycle:\n" + "\n".join(
        f"  {item.where}: {item.source} imports {item.target}" for item in cycle or []
    )


def test_imports_go_downward() -> None:
    wrong = []
    for item in IMPORTS:
        if not allowed(item.source, item.target):
            source, target = unit_of(item.source), unit_of(item.target)
            wrong.append(
                f"  {item.where}: {item.source} (layer {LAYERS[LAYER_OF[source]][0]!r}) imports "
                f"{item.target} (layer {LAYERS[LAYER_OF[target]][0]!r})"
            )
    assert not wrong, "imports that go up or sideways (see docs/architecture.md):\n" + "\n".join(
        wrong
    )


def test_late_imports_say_why() -> None:
    """Imports inside functions are for optional or heavy dependencies, and say which."""
    silent = [item.where for item in IMPORTS if item.in_function and not item.commented]
    assert not silent, "late imports of distcompat modules without a reason comment: " + ", ".join(
        silent
    )


def _doc_table() -> list[tuple[str, tuple[str, ...]]]:
    rows = []
    for line in ARCHITECTURE_DOC.read_text().splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|", line)
        if match:
            units = tuple(re.findall(r"`([\w.]+)`", match.group(3)))
            rows.append((match.group(2), tuple(u.removeprefix("distcompat.") for u in units)))
    return rows


def test_the_doc_shows_the_same_layers() -> None:
    assert _doc_table() == [(name, units) for name, units in LAYERS]


@pytest.mark.parametrize(
    ("source", "target", "ok"),
    [
        ("distcompat.checkpoint._save", "distcompat.collectives._group", True),
        ("distcompat.collectives._group", "distcompat.checkpoint", False),  # up
        ("distcompat.data._tokens", "distcompat.checkpoint", False),  # sideways
        ("distcompat.launch._env", "distcompat.launch._rules", True),  # same unit
    ],
)
def test_the_rule_itself(source: str, target: str, ok: bool) -> None:
    """The layer rule on hand-made pairs, so a broken rule cannot pass an empty tree."""
    assert allowed(source, target) is ok


def test_a_cycle_is_found_and_named() -> None:
    """The cycle finder on a hand-made graph: a -> b -> c -> a, plus a tail."""
    here = Path(__file__)

    def edge(source: str, target: str, line: int) -> Import:
        return Import(source, target, here, line, in_function=False, commented=False)

    graph = [edge("x", "a", 1), edge("a", "b", 2), edge("b", "c", 3), edge("c", "a", 4)]
    cycle = _cycle(graph)
    assert cycle is not None
    assert [(item.source, item.target) for item in cycle] == [("a", "b"), ("b", "c"), ("c", "a")]
    assert _cycle(graph[:3]) is None
