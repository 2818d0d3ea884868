"""The floors of docs/ARCHITECTURE.md hold: every import of the installed package runs down, never up
and never sideways between rooms of one floor, read from the source with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "acre_train"
# floor of each top-level module or package of acre_train (verbs: each package's cli.py, see below)
FLOORS = {
    "errors": 0, "files": 0, "measure": 0, "tiny": 0, "resources": 0,  # resources: data files only
    "modeling": 1, "base": 1,
    "data": 2,
    "train": 3, "infer": 3,
    "export": 4,
    "eval": 5,
    "cli": 6, "quickstart": 6, "reproduce": 6, "recipes_cli": 6, "env_info": 6,
}


def _room(module: Path) -> str:
    rel = module.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _floor(module: Path) -> int:
    if module.name == "cli.py":  # every package's verb module sits with the verbs
        return FLOORS["cli"]
    return FLOORS[_room(module)]


def _imported_rooms(module: Path) -> set[str]:
    """Top-level rooms of acre_train that ``module`` imports (relative or absolute, at any depth)."""
    rel = module.relative_to(PACKAGE)
    rooms = set()
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's own package
                base = list(rel.parts[:-1])[: len(rel.parts) - node.level]
                target = [*base, *(node.module.split(".") if node.module else [])]
                if not target:  # "from .. import x" at the package root: x names the room
                    rooms.update(alias.name for alias in node.names)
                    continue
                rooms.add(target[0])
            elif not node.level and node.module and node.module.split(".")[0] == "acre_train":
                parts = node.module.split(".")
                rooms.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "acre_train" and len(parts) > 1:
                    rooms.add(parts[1])
    return {r for r in rooms if r in FLOORS}


def test_every_module_has_a_floor():
    for module in PACKAGE.rglob("*.py"):
        if module.name == "__init__.py" and module.parent == PACKAGE:
            continue
        assert _room(module) in FLOORS, f"{module}: add its room to docs/ARCHITECTURE.md and FLOORS"


def test_imports_run_down_the_floors():
    wrong = []
    for module in sorted(PACKAGE.rglob("*.py")):
        if module.parent == PACKAGE and module.name == "__init__.py":
            continue
        own, floor = _room(module), _floor(module)
        for room in _imported_rooms(module) - {own}:
            rel = module.relative_to(PACKAGE).as_posix()
            if FLOORS[room] >= floor:
                wrong.append(f"{rel} (floor {floor}) imports {room} (floor {FLOORS[room]})")
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(wrong)


def _module_exists(dotted: list[str]) -> bool:
    path = PACKAGE.joinpath(*dotted)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_import_inside_the_package_names_a_module_that_exists():
    """Lazy imports inside functions run only on the path that needs them; a module that moved leaves
    them pointing nowhere until a user (or a slow test) walks that path. Read them all here."""
    missing = []
    outside = [f for d in ("studies", "benchmarks", "tests") for f in (PACKAGE.parent / d).rglob("*.py")]
    for module in sorted(PACKAGE.rglob("*.py")) + sorted(outside):
        rel = module.relative_to(PACKAGE if module.is_relative_to(PACKAGE) else PACKAGE.parent)
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level and module.is_relative_to(PACKAGE):
                package = list(rel.parts[:-1])
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif not node.level and node.module and node.module.split(".")[0] == "acre_train":
                target = node.module.split(".")[1:]
            else:
                continue
            if not target:
                continue
            if not _module_exists(target):
                # "from .pkg import name": name may be a module of pkg or an attribute; the module must exist
                missing.append(f"{rel.as_posix()}:{node.lineno} imports {'.'.join(target)}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST):
    """Every import node that runs (at module level or in a function), leaving out ``if TYPE_CHECKING:``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            node.body = []  # annotations only: never imported when the code runs
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from .pkg import name`` counts ``pkg.name`` where that
    is a module, else ``pkg``)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in paths}
                continue
            base = here[: len(here) - (node.level - 1)] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                found = f"{target}.{alias.name}" if f"{target}.{alias.name}" in paths else target
                if found in paths and found != name:
                    graph[name].add(found)
    return graph


def test_no_import_circle_anywhere_in_the_package():
    """Floors keep rooms apart; inside a room, modules must not import each other round either (lazy
    imports included): a circle is what makes a module impossible to move or read on its own."""
    graph = _import_graph()
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not circles, "import circles:\n" + "\n".join(circles)
