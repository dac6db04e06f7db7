"""Child processes die with their parent: no orphan ever holds memory or a core.

    die_with_parent(parent_pid)   # first thing in a child process (a worker, a pool process)
    name_process("tessera-tp1")   # what ps, top and psutil's name() show for it (Linux)

PR_SET_PDEATHSIG (Linux) kills the child when the thread that started it exits; a watchdog
thread covers the rest (other platforms, a parent that outlived its spawning thread) by
noticing that the parent changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time


def die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watchdog() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watchdog, daemon=True, name="parent-watchdog").start()


def name_process(name: str) -> None:
    """The process's name as the kernel shows it (comm: ps, top, psutil.Process.name();
    15 bytes at most), so an operator (and a test) can tell a tensor-parallel worker from a
    request-pool process. No-op off Linux."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15])  # PR_SET_NAME
