"""Where Tessera keeps what it builds once per machine: converted models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$TESSERA_CACHE_DIR, else $XDG_CACHE_HOME/tessera (~/.cache/tessera)."""
    if env := os.environ.get("TESSERA_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "tessera"
