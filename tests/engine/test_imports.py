"""The engine's dependencies point one way: no import cycle inside engine/, no import of the
web layer, model files that name no kernel or device module (they stay plain torch modules),
kernels that import nothing above them, and GGUF reading below the models."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Engine modules this file imports, at any depth (function-level imports count: a lazy
    import hides a cycle, it does not remove it), except under `if TYPE_CHECKING:`."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ENGINE.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def _without_package_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ importing its own submodules is not a cycle with them."""
    return {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}


def test_no_import_cycle_in_engine():
    cycle = _cycle(_without_package_parents(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_engine_never_imports_the_web_layer():
    for path in ENGINE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                assert n.split(".")[0] not in ("api", "console"), f"{path} imports {n}"


def test_models_name_no_kernel_or_worker_module():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("engine.models"):
            device = ("engine.kernels", "engine.worker", "engine.layers.gpu_")
            bad = {d for d in deps if d.startswith(device)}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_kernels_and_their_wrappers_import_nothing_above_them():
    """engine/kernels/ (the sources, their bindings and the thin tensor wrappers beside them)
    is the bottom layer: the layers, attention backends and the decode plan call it."""
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("engine.kernels"):
            bad = {d for d in deps if not d.startswith(("engine.kernels", "engine.paths"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_gguf_sits_below_models_and_linear_methods():
    """engine/gguf/ reads files and lays out blocks: the models' loader and the gguf linear
    method import it, never the other way."""
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("engine.gguf"):
            bad = {
                d
                for d in deps
                if d.startswith(("engine.models", "engine.worker", "engine.layers.quantization"))
            }
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_config_takes_its_choices_from_the_registries_without_torch():
    """engine.config's choices are the registries' names (attention backends, linear methods,
    queue policies, KV cache specs), read from modules that import no torch."""
    code = (
        "import sys, engine.config as c\n"
        "from engine.attention.backends import ATTENTION_BACKEND_CHOICES\n"
        "from engine.attention.kv_spec import KV_CACHE_DTYPE_CHOICES, KV_CACHE_SPECS\n"
        "from engine.core.request_queue import POLICIES\n"
        "from engine.layers.quantization import METHODS, QUANTIZATION_CHOICES\n"
        "assert 'torch' not in sys.modules, 'engine.config imported torch'\n"
        "assert c.QUANTIZATION_CHOICES is QUANTIZATION_CHOICES == ('none', *METHODS)\n"
        "assert c.ATTENTION_BACKEND_CHOICES is ATTENTION_BACKEND_CHOICES and c.POLICIES is POLICIES\n"
        "assert c.KV_CACHE_DTYPE_CHOICES is KV_CACHE_DTYPE_CHOICES == tuple(KV_CACHE_SPECS)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ENGINE.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_distributed_imports_only_torch():
    """engine.distributed is imported by layers and the runner alike: torch and the standard
    library only, never another engine module (no cycles) or a heavy dependency."""
    tree = ast.parse((ENGINE / "distributed.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots - {"torch"} <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
