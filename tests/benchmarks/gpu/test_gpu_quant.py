"""benchmarks/gpu/quant.py (`python3 -m benchmarks.gpu.quant`): without CUDA its --quick run (tiny shapes, the Triton kernel under
the interpreter) passes its correctness checks and writes every row, without the web stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]
BLOCK_WEB_STACK = (
    "import sys\nfor n in ('msgspec', 'litestar', 'sqlalchemy'):\n    sys.modules[n] = None\n"
)


def test_quick_cpu_run_checks_and_times_every_variant(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("OUT", None)
    out = tmp_path / "quant.json"
    code = BLOCK_WEB_STACK + (
        "import runpy\n"
        f"sys.argv = ['quant', '--quick', '--json', {str(out)!r}]\n"
        "runpy.run_module('benchmarks.gpu.quant', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| linear | M | kind |" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    checks = [r for r in rows if r["shape"] == "check"]
    assert len(checks) > 20 and all(r["note"] == "ok" for r in checks)
    timed = {(r["shape"], r["m"], r["kind"]) for r in rows if r["us"] is not None}
    for shape in ("qkv", "down"):
        for m in (1, 4):
            kinds = {k for s, mm, k in timed if (s, mm) == (shape, m)}
            assert "bf16 torch.mm" in kinds
            assert "fp8 linear (weight-only fallback)" in kinds
            assert {
                "w4a16 g128 asym, reshape (triton)",
                "w4a16 g128 asym, gather (triton)",
            } <= kinds
