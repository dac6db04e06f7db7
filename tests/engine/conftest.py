"""Fixtures of the engine's kernel tests, and the Triton interpreter where no GPU is."""

from __future__ import annotations

import os

import pytest
import torch

# Without a CUDA device the Triton kernels (engine.kernels.triton) run under Triton's
# interpreter on CPU tensors. Triton reads this when a kernel is defined, so it is set here,
# before any test module imports a kernel module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels.cpu import w8a8 as cpu_w8a8  # noqa: E402


@pytest.fixture(params=["avx512-vnni", "amx"])
def tiles(request):
    """The packed GEMMs' two kinds of tile, each held to the same results: VNNI everywhere,
    AMX where the CPU has it (then it is the default for K % 64 == 0)."""
    amx = request.param == "amx"
    if cpu_w8a8.set_amx(amx) != amx:
        pytest.skip("no AMX on this CPU (or Linux refused it)")
    yield request.param
    cpu_w8a8.set_amx(os.environ.get("TESSERA_AMX") != "0")
