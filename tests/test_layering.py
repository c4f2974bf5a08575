"""The code's shape, checked from the source: modules form layers (every import of our own
modules, at the top or inside a function, runs down: the import graph has no cycle), every module
sits on one of the named FLOORS and imports nothing from a floor above its own, `scheduler/`
imports no JAX, no function is longer than MAX_FUNCTION_LINES and no class than
MAX_CLASS_LINES."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minivllm_jax", "scheduler", "pallas_kernels")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 250
# The floors, top down (docs/DESIGN.md, "The floors"): a module (or package: every module under
# it) imports only from its own floor or those below.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("front ends", ("minivllm_jax.cli", "minivllm_jax.serving")),
    ("offline API", ("minivllm_jax", "minivllm_jax.llm")),
    ("engine", ("minivllm_jax.engine",)),
    ("build", ("minivllm_jax.aot",)),
    ("worker", ("minivllm_jax.worker", "minivllm_jax.loader")),
    ("spec", ("minivllm_jax.engine_spec", "minivllm_jax.kv_cache_sizing",
              "minivllm_jax.step_layout")),
    ("model", ("minivllm_jax.models",)),
    ("sampling", ("minivllm_jax.sampling", "minivllm_jax.structured_output",
                  "minivllm_jax.outputs")),
    ("parallel", ("minivllm_jax.parallel",)),
    ("configs", ("minivllm_jax.config", "minivllm_jax.plan", "minivllm_jax.backends",
                 "minivllm_jax.buckets", "minivllm_jax.model_config")),
    ("kernels", ("pallas_kernels",)),
    ("scheduler", ("scheduler",)),
]


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


def _floor(module: str) -> int:
    """The index in FLOORS of the longest listed name that is `module` or a package above it
    (the root package's name stands for its __init__ alone)."""
    best, floor = "", -1
    for i, (_, names) in enumerate(FLOORS):
        for name in names:
            inside = name != "minivllm_jax" and module.startswith(name + ".")
            if (module == name or inside) and len(name) > len(best):
                best, floor = name, i
    return floor


def test_every_import_stays_on_its_floor_or_goes_down() -> None:
    modules = _modules()
    unplaced = sorted(m for m in modules if _floor(m) < 0)
    assert not unplaced, f"modules on no floor (add them to FLOORS): {unplaced}"
    upward = [f"{m} ({FLOORS[_floor(m)][0]}) imports {t} ({FLOORS[_floor(t)][0]})"
              for m, file in modules.items() for t in sorted(_imports(file, m, modules))
              if _floor(t) < _floor(m)]
    assert not upward, "\n".join(upward)


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
