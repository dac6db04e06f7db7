"""The web layer's dependencies point one way: api/ never imports console/ (the console is
mounted from outside, api/server/plugins.py), api/ has no import cycle between its modules,
and each domain package (openai, keys, tenants, quotas, usage, admin) reaches the others only
through what they export, never the server's app factory or the CLI."""

from __future__ import annotations

from pathlib import Path

from tests.engine.test_imports import _cycle, _imports, _module_name

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "api"
DOMAINS = ("openai", "keys", "tenants", "quotas", "usage", "admin", "db", "lora")


def _graph(roots: tuple[str, ...] = ("api", "console")) -> dict[str, set[str]]:
    """Module -> the modules of `roots` it imports (test_imports' reading of a file: lazy
    imports count, TYPE_CHECKING ones do not; a package's own submodules left out)."""
    files = {_module_name(p): p for r in roots for p in (ROOT / r).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = _imports(path, set(files))
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


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
