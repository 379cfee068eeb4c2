"""The package imports only downward: no import cycle, no import against the layer table.

Reads the source of every module under ``src/distcompat`` with ``ast`` (nothing is imported), takes
every ``import`` of a distcompat module, at module level, under ``TYPE_CHECKING`` and inside
functions, and checks three rules:

* the module graph has no cycle;
* each import goes to the same unit (a subpackage or top-level module) or to a lower layer of
  :data:`LAYERS`, which docs/architecture.md shows as a table;
* an import inside a function carries a comment saying why it is late (an optional or heavy
  dependency): a late import must never be a way round a cycle;
* torch's private names (``torch._C``, ``dist.distributed_c10d._get_default_store``, a private
  method of torch's ``ProcessGroup``) are reached only from the seam, ``distcompat._torch``.

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
    ("base", ("_torch", "_files", "_command", "_version", "_extras", "_scarcity", "_store")),
    ("launch", ("launch",)),
    ("ranks", ("_ranks", "env")),
    ("peers", ("peers",)),
    ("collectives", ("collectives",)),
    ("helpers", ("diagnostics", "checkpoint", "data", "join", "attention", "anysize")),
    ("logging", ("rank_logging",)),
    ("lifecycle", ("process_group",)),
    ("entry points", ("runtime", "testing", "distributed", "preemption", "inplace", "run")),
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


#: The seam: the one package that may reach torch's private names (docs/torch_versions.md).
SEAM = "distcompat._torch"
#: torch's modules that are torch's internals, though not named with an underscore.
INTERNAL_MODULES = ("distributed_c10d", "c10d_logger")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_class_privates() -> set[str]:
    """Private attribute names of the torch classes distcompat's code holds objects of."""
    import torch
    import torch.distributed as dist

    classes = [dist.ProcessGroup, dist.Backend, dist.ProcessGroupGloo, dist.Work, dist.Store]
    classes += [torch.futures.Future, dist.ReduceOp]
    return {name for klass in classes for name in dir(klass) if _private(name)}


def _own_privates() -> set[str]:
    """Private names distcompat defines itself: functions, methods, attributes it assigns."""
    own: set[str] = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    return {name for name in own if _private(name)}


def _torch_aliases(tree: ast.AST) -> set[str]:
    """Names a module binds to torch or one of its modules (``torch``, ``dist``, ``F``...)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            aliases.update(alias.asname or alias.name for alias in node.names)
    return aliases


def _chain(node: ast.Attribute) -> list[str]:
    parts = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if isinstance(value, ast.Name):
        parts.append(value.id)
        return parts[::-1]
    return []


def torch_internals(text: str, class_privates: set[str], own: set[str]) -> list[tuple[int, str]]:
    """Each place ``text`` reaches a torch internal: ``(line, what)``."""
    tree = ast.parse(text)
    aliases = _torch_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for module in modules:
                parts = module.split(".")
                if parts[0] != "torch":
                    continue
                if any(_private(part) or part in INTERNAL_MODULES for part in parts):
                    found.append((node.lineno, f"import of {module}"))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                for alias in node.names:
                    if _private(alias.name) or alias.name in INTERNAL_MODULES:
                        found.append((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _chain(node)
            if chain and chain[0] in aliases:
                found.append((node.lineno, ".".join(chain)))
            elif node.attr in class_privates and node.attr not in own:
                found.append((node.lineno, f"torch's private .{node.attr}"))
    return found


def test_only_the_seam_reaches_torchs_private_names() -> None:
    """Every private or version-dependent torch name goes through distcompat._torch: a new torch
    release is a change there. A private name distcompat defines itself (``self._world``) is not
    torch's; the forwards of the trampoline's names (``self.backend._allgather_base``) are the
    protected group's own methods of the same name (distcompat._torch lists them per release)."""
    class_privates, own = _torch_class_privates(), _own_privates()
    bad = []
    for module, path in sorted(MODULES.items()):
        if module == SEAM or module.startswith(SEAM + "."):
            continue
        for line, what in torch_internals(path.read_text(), class_privates, own):
            bad.append(f"  {path.relative_to(ROOT)}:{line}: {what}")
    assert not bad, "torch internals outside distcompat._torch:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("text", "caught"),
    [
        ("import torch\ntorch._C._set_grad_enabled(False)\n", True),
        ("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()\n", True),
        ("from torch._C import _distributed_c10d\n", True),
        ("from torch.distributed import distributed_c10d\n", True),
        ("from torch.distributed import _functional_collectives\n", True),
        ("def f(group):\n    return group._get_backend(None)\n", True),
        ("import torch.distributed as dist\ndist.all_reduce(x)\n", False),
        ("class A:\n    def f(self):\n        return self._world\n", False),
    ],
)  # fmt: skip
def test_the_seam_rule_itself(text: str, caught: bool) -> None:
    assert bool(torch_internals(text, _torch_class_privates(), {"_world"})) is caught
