"""Real parts a test needs from Debian's packages (chromium, nginx), installed by the test set-up
when missing, as CI does on a fresh machine.

Several test processes may install at once (`make test` runs files in parallel): apt waits for
the other's dpkg lock instead of failing at once."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

_APT = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=600"]


def ensure_debian_binary(
    name: str, package: str, find: Callable[[], str | None] | None = None
) -> str:
    """The path of `name`, installed from Debian's `package` when missing; without apt, a skip
    (a failure under CI: it must run these tests, not skip them quietly)."""
    find = find or (
        lambda: (
            shutil.which(name)
            or next(
                (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if Path(p).exists()), None
            )
        )
    )
    if (found := find()) is not None:
        return found
    if shutil.which("apt-get"):
        install = [*_APT, "install", "-y", package]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run(install, check=False, capture_output=True, env=env).returncode != 0:
            # A fresh machine has no package lists yet.
            subprocess.run([*_APT, "update"], check=False, capture_output=True, env=env)
            subprocess.run(install, check=False, capture_output=True, env=env)
    if (found := find()) is None:
        message = (
            f"Debian {package} is not installed and could not be (apt-get install -y {package})"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found
