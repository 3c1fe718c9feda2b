"""The package's import graph: no cycles, and no module importing from a higher layer.

Layers, lowest first (a module may import its own layer or lower ones):
    0  errors, _compat, _cache_key   1  groups, fp8
    2  comm, validation, kernels,    3  layout, rows, payload
       overlap
    4  backends                      5  api
    6  moe, ulysses, ulysses_exchange, checkpoint, inspect, testing, reference, torchtitan, hierarchical,
       integrations
    7  the package itself (alltoall_ops/__init__.py: the public API)
Function-local imports count as imports.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "alltoall_ops"

LAYERS = {
    "errors": 0, "_compat": 0, "_cache_key": 0, "groups": 1, "fp8": 1, "comm": 2, "validation": 2, "kernels": 2,
    "overlap": 2, "layout": 3, "rows": 3, "payload": 3, "backends": 4, "api": 5, "moe": 6, "ulysses": 6,
    "ulysses_exchange": 6, "checkpoint": 6, "inspect": 6, "testing": 6, "reference": 6, "torchtitan": 6,
    "hierarchical": 6, "integrations": 6,
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from . import x`` resolved to ``pkg.x``)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # ``from pkg import sub`` imports the submodule; ``from mod import name``, the module
                candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            targets |= {c for c in candidates if c in modules and c != name}
        graph[name] = targets
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    return 7 if len(parts) == 1 else LAYERS[parts[1]]


def test_every_module_has_a_layer():
    unplaced = [m for m in _imports() if "." in m and m.split(".")[1] not in LAYERS]
    assert unplaced == [], f"add these to LAYERS: {unplaced}"


def test_no_module_imports_a_higher_layer():
    upward = [(m, t) for m, targets in _imports().items() for t in targets
              if _layer(t) > _layer(m) and not t.startswith(m + ".")]
    assert upward == [], upward


def test_import_graph_has_no_cycles():
    graph = _imports()
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail(f"import cycle: {' -> '.join(stack[stack.index(t):] + [t])}")
            if t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_graph_is_read():
    """The checks above see real edges (guards against a parser that finds nothing)."""
    graph = _imports()
    assert "alltoall_ops.layout" in graph["alltoall_ops.backends.collective"]
    assert "alltoall_ops.kernels.loader" in graph["alltoall_ops.layout"]
    assert "alltoall_ops.rows" in graph["alltoall_ops.backends.local"]
