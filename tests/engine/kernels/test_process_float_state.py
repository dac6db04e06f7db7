"""Loading the C kernels leaves the process's floating-point state alone: no flush-to-zero or
denormals-are-zero for the user's other floats (GCC's crtfastmath.o, linked in by
-ffast-math at link time, used to turn both on for the whole process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.kernels.cpu import ops

CHECK = """
from engine.kernels.cpu import ops
before = 5e-324 * 1.0 != 0.0
assert ops.library() is not None
after = 5e-324 * 1.0 != 0.0
print(before, after)
"""


def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    if ops.library() is None:
        pytest.skip("the C kernels did not build on this machine")
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
