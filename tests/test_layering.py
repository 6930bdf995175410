"""The import layering: common <- broker, actors, learner, testkit <- deploy, and no import circle.

The roles talk only through the wire (docs/protocol.md), so none imports another; ``common`` is
what they share and imports none of them; ``deploy`` wires them together. ``testkit`` (scripted
peers and synthetic data for tests and benchmarks) speaks the wire through ``common`` only. A lazy import inside a
function counts too: it is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "broker", "actors", "learner", "testkit", "deploy")
ALLOWED = {
    "common": {"common"},
    "broker": {"common", "broker"},
    "actors": {"common", "actors"},
    "learner": {"common", "learner"},
    "testkit": {"common", "testkit"},
    "deploy": set(PACKAGES),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Project modules ``path`` imports anywhere (``from a.b import c`` counts as a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_roles_never_import_each_other_and_common_imports_no_role():
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources()
        for name in sorted(imports(path))
        if name.split(".")[0] not in ALLOWED[path.relative_to(ROOT).parts[0]]
    ]
    assert not wrong, wrong


def test_no_import_circle():
    """Lazy imports count: a circle closed inside a function is still a circle (it worked only
    because of the order in which modules happened to load)."""
    modules = {module_name(p): p for p in sources()}
    graph = {
        name: {m for m in imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                raise AssertionError(f"import circle: {' -> '.join([*path, name, dep])}")
            if dep not in state:
                visit(dep, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
