"""The web layer's dependencies point one way: api/ never imports console/ (the console is
mounted from outside, api/server/plugins.py), api/ has no import cycle between its modules,
and each domain package (openai, keys, tenants, quotas, usage, admin) reaches the others only
through what they export, never the server's app factory or the CLI."""

from __future__ import annotations

from pathlib import Path

from tests.engine.test_imports import _cycle, _imports, _is_type_checking  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "api"
DOMAINS = ("openai", "keys", "tenants", "quotas", "usage", "admin", "db")


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(roots: tuple[str, ...] = ("api", "console")) -> dict[str, set[str]]:
    files = {_name(p): p for r in roots for p in (ROOT / r).rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        deps = _imports_any(path, name, modules)
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _imports_any(path: Path, name: str, modules: set[str]) -> set[str]:
    import ast

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


def test_api_never_imports_console():
    for name, deps in _graph().items():
        if name.startswith("api"):
            bad = sorted(d for d in deps if d.split(".")[0] == "console")
            assert not bad, f"{name} imports {bad}: mount the console from outside"


def test_no_import_cycle_in_api():
    graph = {n: d for n, d in _graph(("api",)).items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_domains_never_import_the_app_factory_or_the_cli():
    for name, deps in _graph(("api",)).items():
        if name.split(".")[1:2] and name.split(".")[1] in DOMAINS:
            bad = sorted(d for d in deps if d.startswith(("api.server.app", "api.cli")))
            assert not bad, f"{name} imports {bad}"


def test_the_layout_is_by_domain():
    """No module at api/'s top level: each lives in its domain's package."""
    loose = sorted(p.name for p in API.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a domain package: {loose}"
