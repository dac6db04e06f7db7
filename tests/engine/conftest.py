"""Fixtures of the engine's kernel tests."""

from __future__ import annotations

import os

import pytest

from engine.layers import cpu_w8a8


@pytest.fixture(params=["avx512-vnni", "amx"])
def tiles(request):
    """The packed GEMMs' two kinds of tile, each held to the same results: VNNI everywhere,
    AMX where the CPU has it (then it is the default for K % 64 == 0)."""
    amx = request.param == "amx"
    if cpu_w8a8.set_amx(amx) != amx:
        pytest.skip("no AMX on this CPU (or Linux refused it)")
    yield request.param
    cpu_w8a8.set_amx(os.environ.get("TESSERA_AMX") != "0")
