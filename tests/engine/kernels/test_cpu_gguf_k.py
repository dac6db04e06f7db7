"""The K-quants (Q4_K, Q5_K, Q6_K) on the CPU kernels (engine.kernels.cpu.gguf, gguf_k.c):
the dequantizer bit for bit against gguf-py's, every kernel variant this build has (forced)
against F.linear on gguf-py's dequantized weight, row segments of mixed types, and the K the
superblocks refuse. Blocks come from tests/engine/kernels/kquant_blocks.py (random bytes, and
a numpy encoder of real weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from engine.kernels.cpu import gguf as cpu_gguf
from engine.kernels.cpu import ops
from tests.engine.kernels.kquant_blocks import quantize, random_blocks

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")

K_TYPES = sorted(cpu_gguf.K_TYPES)
DOT_ROWS = 16  # the dot kernels forced up to this many rows (this CPU may hand fewer to them)


def _ref(raw: np.ndarray, name: str, k: int) -> torch.Tensor:
    w = dequantize(raw, GGMLQuantizationType[name]).reshape(raw.shape[0], k)
    return torch.from_numpy(w.astype(np.float32))


def _blocks(name: str, n: int, k: int, seed: int, encoded: bool):
    rng = np.random.default_rng(seed)
    if encoded:
        raw = quantize((rng.standard_normal((n, k)) * 0.1).astype(np.float32), name)
    else:
        raw = random_blocks(name, n, k, rng)
    return torch.from_numpy(raw), _ref(raw, name, k)


def _quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 per block of 32 with scale amax / 127, back to float."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("isa", cpu_gguf.isa_names())  # scalar, and the vectors' (AVX2)
@pytest.mark.parametrize("encoded", [False, True], ids=["random", "encoded"])
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("name", K_TYPES)
def test_dequantize_matches_gguf_py(name, k, encoded, isa):
    raw, ref = _blocks(name, 7, k, 0, encoded)
    type_id = cpu_gguf.TYPES[name]
    assert raw.shape[1] == cpu_gguf.row_bytes(type_id, k)
    row, row16 = torch.empty(k), torch.empty(k, dtype=torch.bfloat16)  # the per-row entries
    with cpu_gguf.forced_isa(isa), cpu_gguf.forced_dot_rows(DOT_ROWS):
        assert torch.equal(cpu_gguf.dequantize(raw, type_id, k, torch.float32), ref)
        assert torch.equal(cpu_gguf.dequantize(raw, type_id, k, torch.bfloat16), ref.bfloat16())
        assert (
            ops.function("gguf_k_dequant_row")(type_id, raw[3].data_ptr(), k, row.data_ptr()) == 0
        )
        assert (
            ops.function("gguf_k_dequant_row_bf16")(type_id, raw[3].data_ptr(), k, row16.data_ptr())
            == 0
        )
    assert torch.equal(row, ref[3]) and torch.equal(row16, ref[3].bfloat16())


# Against the float reference the error is x's int8 rounding: up to 1/254 of a block's amax
# per element, ~1/(254 sqrt(3)) rms, so a relative error of ~3e-3 that does not average away
# (the reference's own terms carry it): 2e-2 leaves margin. Against the reference computed on
# x rounded the kernel's way only the float sums' order differs (~1e-6), plus a rare code that
# rounds the other way at a tie; a bf16 output adds its own rounding (2^-9 relative).
_TOL = {torch.float32: 2e-2, torch.bfloat16: 2.5e-2}
_TOL_QX = {torch.float32: 2e-3, torch.bfloat16: 6e-3}


@pytest.mark.parametrize("isa", cpu_gguf.isa_names())
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_dequantized_reference(isa, name, k, dtype):
    torch.manual_seed(1)
    n = 37  # odd output rows (the tasks' tail)
    raw, ref_w = _blocks(name, n, k, 1, encoded=True)
    bias = torch.randn(n).to(dtype)
    for m in (1, 3, 5, 17):  # 4-row tiles' remainders; 17 > DOT_ROWS: the large-batch path
        x = torch.randn(m, k).to(dtype)
        ref = F.linear(x.float(), ref_w, bias.float())
        with cpu_gguf.forced_isa(isa), cpu_gguf.forced_dot_rows(DOT_ROWS):
            y = cpu_gguf.linear(x, raw, cpu_gguf.TYPES[name], k, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        err = (y.float() - ref).norm() / ref.norm()
        assert err < _TOL[dtype], (m, float(err))
        if m <= DOT_ROWS:
            ref_q = F.linear(_quantized_x(x).double(), ref_w.double(), bias.double())
            err_q = (y.double() - ref_q).norm() / ref_q.norm()
            assert err_q < _TOL_QX[dtype], (m, float(err_q))


@pytest.mark.parametrize("name", K_TYPES)
def test_variants_agree_on_random_blocks(name):
    raw, ref_w = _blocks(name, 24, 512, 2, encoded=False)  # every code and scale pattern
    x = torch.randn(7, 512)
    outs = []
    for isa in cpu_gguf.isa_names():
        with cpu_gguf.forced_isa(isa), cpu_gguf.forced_dot_rows(DOT_ROWS):
            outs.append(cpu_gguf.linear(x, raw, cpu_gguf.TYPES[name], 512))
    for y in outs[1:]:  # the same integer sums, scaled in a different order
        torch.testing.assert_close(y, outs[0], rtol=1e-4, atol=1e-4 * float(outs[0].abs().max()))
    ref = _quantized_x(x).double() @ ref_w.double().T
    assert (outs[0].double() - ref).norm() / ref.norm() < _TOL_QX[torch.float32]


def test_segments_of_mixed_types_fill_their_columns():
    torch.manual_seed(3)
    k = 512
    parts = [("Q4_K", 24), ("Q6_K", 8), ("Q8_0", 5), ("Q5_K", 3)]
    segments, weights = [], []
    for i, (name, rows) in enumerate(parts):
        if name in cpu_gguf.K_TYPES:
            raw, w = _blocks(name, rows, k, 10 + i, encoded=True)
        else:  # a 32-block type next to the superblocks
            w = np.random.default_rng(i).standard_normal((rows, k)).astype(np.float32) * 0.1
            q = gguf_quantize(w, GGMLQuantizationType[name])
            raw, w = torch.from_numpy(q), _ref(q, name, k)
        segments.append((cpu_gguf.TYPES[name], raw))
        weights.append(w)
    bias = torch.randn(sum(rows for _, rows in parts))
    for isa in cpu_gguf.isa_names():
        for m in (1, 5, 17):
            x = torch.randn(m, k)
            with cpu_gguf.forced_isa(isa), cpu_gguf.forced_dot_rows(DOT_ROWS):
                y = cpu_gguf.linear_segments(x, tuple(segments), k, bias)
            assert y.shape == (m, bias.shape[0])
            ref = F.linear(x, torch.cat(weights), bias)
            col = 0
            for _, rows in parts:  # every segment's own columns, each against its reference
                part, ref_part = y[:, col : col + rows], ref[:, col : col + rows]
                err = (part - ref_part).norm() / ref_part.norm()
                assert err < _TOL[torch.float32], (isa, m, col, float(err))
                col += rows


def test_refuses_what_it_cannot_read():
    type_id = cpu_gguf.TYPES["Q4_K"]
    assert cpu_gguf.refusal(type_id, 512) is None
    assert "256" in cpu_gguf.refusal(type_id, 288)  # K % 256: a superblock is 256 weights
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError):
        cpu_gguf.linear(torch.randn(1, 288), raw, type_id, 288)
    with pytest.raises(ValueError):
        cpu_gguf.dequantize(raw, type_id, 288, torch.float32)
    row = torch.empty(288)
    assert ops.function("gguf_k_dequant_row")(type_id, raw.data_ptr(), 288, row.data_ptr()) == -1
