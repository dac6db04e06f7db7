"""Build the CPU kernels' C sources into one shared library, once per machine.

The kernels are plain C: no torch headers, so they compile in seconds with the system
compiler. They are built with -march=native into the cache dir under a key over every source
and header, the compiler, the flags and the CPU, so a shared cache never runs code built for
another machine. The sources are read as package data (importlib.resources), so an installed
wheel builds the same library as a checkout. Each .c file compiles to its own object (in
parallel), then one link: one library, so the decode plan calls the other kernels directly.
ctypes drops the GIL around each call. OpenMP loops run on torch's own thread pool: the
library links libgomp.so.1, which resolves to the copy torch already loaded.

TESSERA_CPU_KERNELS=0 disables every kernel (the torch paths run).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

from engine.paths import default_cache_dir

logger = logging.getLogger("tessera.engine")

PACKAGE = "engine.kernels.cpu"
HEADER = "tessera_kernels.h"
LIBRARY = "tessera_kernels"
# Each object compiles with these. The link leaves -ffast-math out: with it, GCC links
# crtfastmath.o into the library, whose constructor turns on flush-to-zero and
# denormals-are-zero for the whole process that loads it (every float in the user's Python
# process, torch's and numpy's included), not just for these kernels.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # the library, or None; decided once per process


@functools.cache
def cpu_flags() -> str:
    """The "flags" line of /proc/cpuinfo ("" where there is none); read once (dense_linear
    asks on every prefill call, and the read took ~2% of a prefill step)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def kernels_enabled() -> bool:
    return os.environ.get("TESSERA_CPU_KERNELS", "1") != "0"


def sources() -> dict[str, str]:
    """Every C source and header of the package, by path relative to it ("gemm.c",
    "include/tessera_kernels.h"), sorted by path."""
    root = resources.files(PACKAGE)
    found = {e.name: e for e in root.iterdir() if e.name.endswith(".c")}
    found |= {f"include/{e.name}": e for e in root.joinpath("include").iterdir()}
    return {p: found[p].read_text() for p in sorted(found) if p.endswith((".c", ".h"))}


def header_text() -> str:
    return resources.files(PACKAGE).joinpath("include", HEADER).read_text()


def _key(srcs: dict[str, str], cc: str) -> str:
    h = hashlib.sha256()
    for part in [*(f"{p}\0{t}" for p, t in srcs.items()), cc, *LINK_FLAGS, cpu_flags()]:
        h.update(part.encode())
        h.update(b"\0\0")
    return h.hexdigest()


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def build(cache_dir: Path) -> Path | None:
    """The library's path in cache_dir/kernels (compiled first where it is not there), or None
    (no compiler, or a compile failed: logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        logger.info("No C compiler found: the torch paths run instead of the CPU kernels")
        return None
    srcs = sources()
    so = cache_dir / "kernels" / f"{LIBRARY}-{_key(srcs, cc)[:16]}.so"
    if so.is_file():
        return so
    so.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Compiling the CPU kernels once; cached at %s", so)
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        src_dir = Path(tmp) / "src"
        (src_dir / "include").mkdir(parents=True)
        for rel, text in srcs.items():  # the exact bytes the key covers
            (src_dir / rel).write_text(text)
        c_files = [src_dir / rel for rel in srcs if rel.endswith(".c")]
        objects = [Path(tmp) / f"{c.stem}.o" for c in c_files]
        include = ["-I", str(src_dir / "include")]
        workers = max(1, min(len(c_files), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            procs = list(
                pool.map(
                    lambda c_o: _run([cc, *FLAGS, *include, "-c", str(c_o[0]), "-o", str(c_o[1])]),
                    zip(c_files, objects, strict=True),
                )
            )
        out = Path(tmp) / so.name
        failed = [(c.name, p) for c, p in zip(c_files, procs, strict=True) if p.returncode]
        if not failed:
            link = _run([cc, *LINK_FLAGS, *map(str, objects), "-o", str(out), "-lm"])
            failed = [("link", link)] if link.returncode else []
        if failed:
            what, proc = failed[0]
            logger.warning(
                "Building the CPU kernels failed (%s); using the torch paths:\n%s",
                what,
                proc.stderr[-2000:],
            )
            return None
        os.replace(out, so)  # atomic: concurrent builders never load a half-written file
    return so


def load_library() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None: disabled, no compiler, failure.
    The answer is remembered for the process (so a failure is logged once, and later calls on
    the hot path cost a list lookup)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        lib = None
        if kernels_enabled():
            try:
                path = build(default_cache_dir())
                if path is not None:
                    lib = ctypes.CDLL(str(path))
            except (OSError, subprocess.SubprocessError) as e:
                logger.warning("Loading the CPU kernels failed (%s); torch paths", e)
                lib = None
        _loaded.append(lib)
        return lib
