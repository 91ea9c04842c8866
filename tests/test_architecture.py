"""The house's rules, checked on every import in the package (function-level ones too): no module imports itself
back through others, and no room imports a room above it (data flows one way: dataset -> generator -> samples ->
policy -> weights -> engines, with the driver and the entry points on top)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "skyrl_stepwise"
# bottom to top: a room may import the rooms before it, never one after it
ROOMS = ("host", "models", "chat", "sandbox", "retrieval", "tools", "envs", "data", "inference", "generator",
         "gateway", "algorithms", "checkpoint", "policy", "ablation", "loop", "view", "run", "cli")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (`from pkg.room import module` counts the
    module; `from pkg.room.module import name` the module)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`module -> module` for each import whose room stands above the importer's room in ROOMS."""
    bad = []
    for module, deps in graph.items():
        for dep in deps:
            here, there = room(module), room(dep)
            if here in ROOMS and there in ROOMS and ROOMS.index(there) > ROOMS.index(here):
                bad.append(f"{module} ({here}) imports {dep} ({there})")
    return sorted(bad)


def test_every_room_is_in_the_order_and_the_root_holds_no_loose_module():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert rooms == set(ROOMS), sorted(rooms ^ set(ROOMS))
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py"]


def test_no_import_circle_anywhere_in_the_package():
    assert cycles(import_graph()) == []


def test_no_room_imports_a_room_above_it():
    assert upward_imports(import_graph()) == []


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
    pkg = tmp_path / "skyrl_stepwise"
    for room_name, text in (("host", "from skyrl_stepwise.cli import main\n"),
                            ("cli", "def main():\n    import skyrl_stepwise.host\n")):
        (pkg / room_name).mkdir(parents=True)
        (pkg / room_name / "__init__.py").write_text(text)
    graph = import_graph(pkg)
    assert cycles(graph) == [["skyrl_stepwise.cli", "skyrl_stepwise.host"]]
    assert upward_imports(graph) == ["skyrl_stepwise.host (host) imports skyrl_stepwise.cli (cli)"]
