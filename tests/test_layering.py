"""The code's shape, checked from the source: modules form layers (every import of our own
modules, at the top or inside a function, runs down: the import graph has no cycle), `scheduler/`
imports no JAX, no function is longer than MAX_FUNCTION_LINES and no class than
MAX_CLASS_LINES."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minivllm_jax", "scheduler", "pallas_kernels")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            parts = file.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = file
    return out


def _imports(file: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Our modules that `file` (module `name`) imports, anywhere in it. A package's own
    __init__ re-exporting its submodules is the package's face, not a layer: skipped."""
    found = set()
    is_package = file.name == "__init__.py"
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and not (is_package and t.startswith(name + ".")):
                found.add(t)
    # importing a submodule imports its package __init__ first: that is no edge of ours
    return {t for t in found if not name.startswith(t + ".")}


def test_imports_run_down_only() -> None:
    """The import graph of our modules is acyclic: there is an order in which each module
    imports only modules before it."""
    modules = _modules()
    graph = {name: _imports(file, name, modules) for name, file in modules.items()}
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, f"import cycle: {' -> '.join(path + [node])}"
        state[node] = 1
        for dep in sorted(graph[node]):
            visit(dep, path + [node])
        state[node] = 2
        order.append(node)

    for node in sorted(graph):
        visit(node, [])
    assert len(order) == len(modules)


def test_scheduler_imports_no_jax() -> None:
    for file in sorted((ROOT / "scheduler").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("jax", "jaxlib", "flax", "minivllm_jax",
                                               "pallas_kernels") for n in names), (file, names)


def test_no_function_is_too_long() -> None:
    long = []
    for file in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{file.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "\n".join(long)


def test_no_class_is_too_long() -> None:
    long = [f"{file.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
            for file in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))
            for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, ast.ClassDef)
            and (lines := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES]
    assert not long, "\n".join(long)
