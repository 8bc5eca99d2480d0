"""The shape of the code: small modules, no import cycles (TYPE_CHECKING ones included), a library below daemons.

Read from the source with ``ast`` so that an import inside ``if TYPE_CHECKING:`` or a function counts too:
a cycle hidden from the interpreter is still a cycle for whoever reads the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "peer", "coordinator")
MAX_LINES = 500


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if "pb" in rel.parts:  # generated protobuf code
                continue
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            found[name] = path
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every project module ``path`` imports, wherever the import statement sits."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, name, known) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_even_under_type_checking() -> None:
    g = graph()
    # a package's __init__ importing its own modules is not a design cycle
    for name in g:
        g[name] = {m for m in g[name] if not (m != name and name.startswith(m + ".") and m in g)}
    assert cycles(g) == []


def test_the_library_imports_nothing_above_it() -> None:
    bad = sorted(
        f"{name} -> {m}"
        for name, deps in graph().items()
        if name.split(".")[0] == "swarm"
        for m in deps
        if m.split(".")[0] in ("peer", "coordinator")
    )
    assert bad == []


def test_peer_and_coordinator_never_import_each_other() -> None:
    bad = sorted(
        f"{name} -> {m}"
        for name, deps in graph().items()
        for m in deps
        if {name.split(".")[0], m.split(".")[0]} == {"peer", "coordinator"}
    )
    assert bad == []


def test_no_module_is_longer_than_about_500_lines() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
