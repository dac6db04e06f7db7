"""A regular (non-editable) install, away from the checkout: build Tessera's wheel from the files
the Dockerfile's build stage copies, install it into a fresh virtualenv, run `tessera db upgrade`
and `tessera serve` (the default model) from there, and use the console's login page and static
files, /health and a chat completion; SIGTERM then ends the server with status 0.

Nothing is downloaded: the wheel is built without build isolation, installed with --no-deps,
and the new venv sees the project's dependencies through a .pth file naming this interpreter's
site-packages. A .pth line is a plain sys.path entry: the .pth files in that folder (the dev
venv's editable-install hook among them) are not run, which the first test checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from api.db.migrate import head_revisions
from tests.api.conftest import ServerProcess
from tests.conftest import private_cache_dir

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ADMIN = "wheel-test-admin-token"
# repository folder -> where the wheel installs it (setup.py's DATA_FOLDERS)
DATA_FOLDERS = {
    "templates": "console/templates",
    "static": "console/static",
    "migrations": "api/db/migrations",
}


def dockerfile_sources() -> list[str]:
    """What the Dockerfile's build stage copies in to build the wheel from (its COPY lines
    without --from: `COPY a b ./` and `COPY engine ./engine`)."""
    names = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            names += words[1:-1]
    return names


class Installed:
    """The wheel, its virtualenv, and a working directory outside the repository."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.wheel = Path()  # set by build_and_install, with site_packages
        self.site_packages = Path()
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.tessera = self.venv / "bin" / "tessera"
        self.cwd = root / "run"
        self.cwd.mkdir()
        # The installed commands must not find the checkout through PYTHONPATH.
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("TESSERA_") and k != "PYTHONPATH"
        }

    def run(self, *cmd: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(c) for c in cmd],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}{done.stderr}"
        return done


def build_and_install(root: Path) -> Installed:
    inst = Installed(root)
    src = root / "src"
    src.mkdir()
    for name in dockerfile_sources():
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    wheels = root / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    inst.run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, src)
    (inst.wheel,) = wheels.glob("tessera-*.whl")
    inst.run(sys.executable, "-m", "venv", "--without-pip", inst.venv)
    # This pip installs into the new venv's interpreter, before the .pth exists: it sees no
    # tessera there (the dev venv's editable one would otherwise count as installed).
    inst.run(*pip, "--python", inst.python, "install", "-q", "--no-deps", "--no-index", inst.wheel)
    site = inst.run(inst.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    inst.site_packages = Path(site.stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (inst.site_packages / "tessera_test_deps.pth").write_text("\n".join(ours) + "\n")
    return inst


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    with tempfile.TemporaryDirectory(prefix="tessera-wheel-") as tmp:
        yield build_and_install(Path(tmp))


def test_the_wheel_carries_the_data_folders_inside_tesseras_packages(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    top = {n.split("/")[0] for n in names}
    assert top == {"api", "benchmarks", "console", "engine", "tessera-0.1.0.dist-info"}
    for folder, target in DATA_FOLDERS.items():
        files = [
            p for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        ]
        assert files
        for path in files:
            assert f"{target}/{path.relative_to(REPO / folder).as_posix()}" in names
    # the vendored htmx travels with its licence and version file
    assert {"console/static/vendor/htmx/LICENSE", "console/static/vendor/htmx/VERSION"} <= names


def test_the_venv_imports_the_installed_packages_not_the_checkout(installed):
    probe = """
import json, sys
import api.db.migrate, console.render, engine
print(json.dumps({
    "files": [m.__file__ for m in (engine, api.db.migrate, console.render)],
    "data": [str(console.render.TEMPLATE_DIR), str(console.render.STATIC_DIR),
             str(api.db.migrate.migrations_dir())],
    "editable": [m for m in sys.modules if m.startswith("__editable__")]
    + [type(f).__module__ for f in sys.meta_path if "editable" in type(f).__module__],
}))
"""
    seen = json.loads(installed.run(installed.python, "-c", probe).stdout)
    assert seen["editable"] == []
    site = installed.site_packages.resolve()
    for path in seen["files"] + seen["data"]:
        assert Path(path).resolve().is_relative_to(site), path
    assert Path(seen["data"][0]).resolve() == site / "console" / "templates" / "console"


@pytest.fixture(scope="module")
def database_url(installed) -> str:
    return f"sqlite+aiosqlite:///{installed.root / 'tessera.db'}"


def test_db_upgrade_finds_the_installed_migrations(installed, database_url):
    upgrade = installed.run(installed.tessera, "db", "upgrade", "--database-url", database_url)
    heads = head_revisions()  # the checkout's migrations
    assert f"upgraded to revision {', '.join(heads)}" in upgrade.stdout
    check = installed.run(installed.tessera, "db", "check", "--database-url", database_url)
    assert "up to date" in check.stdout


def test_the_installed_kernel_sources_key_the_checkouts_library(installed):
    """The C sources travel as package data: the installed package finds every one and keys
    its CPU kernel library as the checkout does, so the library the server below finds in
    the cache is the one it would compile."""
    from engine.kernels.cpu import build

    probe = (
        "import json; from engine.kernels.cpu import build as b; "
        "s = b.sources(); print(json.dumps([sorted(s), b._key(s, 'cc')]))"
    )
    names, key = json.loads(installed.run(installed.python, "-c", probe).stdout)
    ours = build.sources()
    assert names == sorted(ours) and any(n.endswith(".c") for n in names)
    assert key == build._key(ours, "cc")


@pytest.fixture(scope="module")
def server(installed, database_url, default_model_dir) -> Iterator[ServerProcess]:
    # The default model's cache, converted once per session by tests/conftest.py, with the
    # compiled kernels linked in (the test above: the same library).
    cache_dir = private_cache_dir(default_model_dir.parent.parent)
    args = ["--admin-token", ADMIN, "--database-url", database_url]
    args += ["--max-model-len", "512", "--num-kv-blocks", "256"]
    proc = ServerProcess(
        args,
        installed.root / "server.log",
        env={"TESSERA_CACHE_DIR": str(cache_dir)},
        serve=[str(installed.tessera), "serve"],
        cwd=installed.cwd,
    )
    proc.cache_dir = cache_dir
    try:
        proc.wait_healthy(timeout=300)
    except BaseException:
        proc.stop()
        raise
    yield proc
    proc.stop()


def test_console_login_page_and_its_static_files(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        page = client.get("/console/login")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<form method="post" action="/console/login">' in page.text
        assert 'name="token" type="password"' in page.text
        assets = re.findall(r'(?:href|src)="(/console/static/[^"]+)"', page.text)
        assert "/console/static/console/console.css" in assets
        assert "/console/static/vendor/htmx/htmx.min.js" in assets
        for asset in assets:
            r = client.get(asset)
            assert r.status_code == 200 and r.content, asset
            name = asset.removeprefix("/console/static/")
            assert r.content == (REPO / "static" / name).read_bytes(), asset
        # logging in renders the dashboard from the installed templates
        csrf = re.search(r'name="_csrf" value="([^"]+)"', page.text).group(1)
        form = {"token": ADMIN, "_csrf": csrf, "next": "/console"}
        r = client.post("/console/login", data=form, follow_redirects=False)
        assert r.status_code == 302 and r.headers["location"] == "/console"
        dashboard = client.get("/console")
        assert dashboard.status_code == 200 and 'id="live"' in dashboard.text


def test_health_and_a_chat_completion_with_a_key_from_the_installed_cli(
    installed, database_url, server
):
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    created = installed.run(
        installed.tessera, "keys", "create", "wheel-test", "--json", "--database-url", database_url
    )
    key = json.loads(created.stdout)["key"]
    headers = {"Authorization": f"Bearer {key}"}
    models = httpx.get(server.base_url + "/v1/models", headers=headers, timeout=10)
    assert models.status_code == 200
    body = {
        "model": models.json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "Name the capital of France."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    r = httpx.post(
        server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] >= 1
    if shutil.which("cc") or shutil.which("gcc"):
        # the CPU kernels ran (the cache's library: the installed sources' key, test above),
        # not skipped for torch's paths
        assert list((server.cache_dir / "kernels").glob("*.so"))
        assert "torch path" not in server.log(tail=None)
    unauthorised = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert unauthorised.status_code == 401


def test_sigterm_stops_the_server_with_status_0_and_no_child_left(server):
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert server.stop() == 0, server.log()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
