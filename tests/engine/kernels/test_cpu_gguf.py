"""GGUF blocks on the CPU kernels (engine.kernels.cpu.gguf): blocks made by gguf-py's own
quantizers (IQ4_NL, NVFP4: tests/engine/kernels/kquant_blocks.py's), the kernel's dequantizer against gguf-py's, and every kernel variant this build
has (the faster ones forced down to the slower) against F.linear on the dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.kernels.cpu import gguf as cpu_gguf
from tests.engine.kernels import kquant_blocks

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="needs the CPU kernels")

TYPES = sorted(set(cpu_gguf.TYPES) - set(cpu_gguf.K_TYPES))  # K-quants: test_cpu_gguf_k.py
DOT_ROWS = 16  # the dot kernels forced up to this many rows (this CPU may hand fewer to them)


def _k(name: str, k: int) -> int:
    """k rounded up to the type's blocks along K (NVFP4's superblocks of 64)."""
    qk = cpu_gguf.block_weights(cpu_gguf.TYPES[name])
    return -(-k // qk) * qk


def _blocks(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (file blocks uint8 [N, row bytes], their float32 weight)."""
    qtype = GGMLQuantizationType[name]
    if name in kquant_blocks.TYPES:  # IQ4_NL, NVFP4: gguf-py has no encoder
        raw = kquant_blocks.quantize(w.numpy(), name)
    else:
        raw = quantize(w.numpy().astype(np.float32), qtype)
    ref = dequantize(raw, qtype).reshape(w.shape)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(ref.astype(np.float32))


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_matches_gguf_py(name):
    torch.manual_seed(0)
    k = _k(name, 96)
    w = torch.randn(7, k) * torch.logspace(-3, 1, 7)[:, None]
    raw, ref = _blocks(w, name)
    assert raw.shape[1] == cpu_gguf.row_bytes(cpu_gguf.TYPES[name], k)
    back = cpu_gguf.dequantize(raw, cpu_gguf.TYPES[name], k, torch.float32)
    assert torch.equal(back, ref)


def test_nvfp4_every_byte_dequantizes_as_gguf_py():
    """NVFP4 superblocks of random bytes: every ue4m3 scale byte (subnormals, 0x7F read as 0,
    bit 7 ignored) and every code in every position, decoded bit for bit as gguf-py does, by
    the dequantizer and the AMX path's row decoder alike."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(16, 4 * 36), dtype=np.uint8)
    raw.reshape(16, 4, 36)[:, :, :4] = np.arange(256, dtype=np.uint8).reshape(16, 4, 4)
    ref = dequantize(raw, GGMLQuantizationType.NVFP4).reshape(16, 256)
    back = cpu_gguf.dequantize(torch.from_numpy(raw), cpu_gguf.TYPES["NVFP4"], 256, torch.float32)
    assert torch.equal(back, torch.from_numpy(ref.astype(np.float32)))


# int8 activations per block of 32: relative error ~ 1/254 per element, averaging down over K
_TOL = {torch.float32: 1.5e-2, torch.bfloat16: 2.5e-2}


@pytest.mark.parametrize("isa", cpu_gguf.isa_names())
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_dequantized_reference(isa, name, dtype):
    torch.manual_seed(1)
    # odd output rows, an odd count of blocks (the VNNI pairs' tail; NVFP4: of superblocks)
    n, k = 37, _k(name, 160)
    w = torch.randn(n, k) * 0.1
    raw, ref_w = _blocks(w, name)
    bias = torch.randn(n).to(dtype)
    for m in (1, 2, 7, 16):  # every remainder of the 4-row tiles, up to the dot limit
        x = torch.randn(m, k).to(dtype)
        ref = F.linear(x.float(), ref_w, bias.float())
        with cpu_gguf.forced_isa(isa), cpu_gguf.forced_dot_rows(DOT_ROWS):
            y = cpu_gguf.linear(x, raw, cpu_gguf.TYPES[name], k, bias)
        assert y.dtype == dtype and y.shape == (m, n)
        err = (y.float() - ref).norm() / ref.norm()
        assert err < _TOL[dtype], (m, float(err))


@pytest.mark.parametrize("name", TYPES)
def test_variants_agree_and_large_batches_dequantize(name):
    torch.manual_seed(2)
    n, k = 24, _k(name, 96)
    raw, ref_w = _blocks(torch.randn(n, k), name)
    x = torch.randn(5, k)
    outs = []
    for isa in cpu_gguf.isa_names():
        with cpu_gguf.forced_isa(isa), cpu_gguf.forced_dot_rows(DOT_ROWS):
            outs.append(cpu_gguf.linear(x, raw, cpu_gguf.TYPES[name], k))
    for y in outs[1:]:  # the same integer sums, scaled in a different order
        torch.testing.assert_close(y, outs[0], rtol=1e-4, atol=1e-4)
    big = torch.randn(cpu_gguf.dot_max_rows() + 3, k)  # float32: dequantize + GEMM: exact
    torch.testing.assert_close(cpu_gguf.linear(big, raw, cpu_gguf.TYPES[name], k), big @ ref_w.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_batches_dequantize_by_slices(monkeypatch, dtype):
    """Above the dot kernels' rows (off AMX) the weight is dequantized a slice of rows at a
    time, each slice's outputs in place: with slices of 64 rows over 200 (a partial last one)
    and a bias, the float32 GEMM on the whole dequantized weight's values."""
    torch.manual_seed(3)
    n, k = 200, 128
    raw, ref_w = _blocks(torch.randn(n, k) * 0.1, "Q8_0")
    bias = torch.randn(n).to(dtype)
    x = torch.randn(2, 9, k).to(dtype)  # any leading shape
    monkeypatch.setattr(cpu_gguf, "DEQUANT_SLICE_BYTES", 64 * k * x.element_size())
    y = cpu_gguf._dense_by_slices(x, raw, cpu_gguf.TYPES["Q8_0"], k, bias)
    assert y.shape == (2, 9, n) and y.dtype == dtype
    ref = F.linear(x.float(), ref_w, bias.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), ref, **tol)
    whole = cpu_gguf.dequantize(raw, cpu_gguf.TYPES["Q8_0"], k, dtype)
    with pytest.raises(AssertionError):  # a reused buffer of the wrong shape is refused
        cpu_gguf.dequantize(raw, cpu_gguf.TYPES["Q8_0"], k, dtype, out=whole[:10])


def test_refuses_what_it_cannot_read():
    raw = torch.zeros(4, 18, dtype=torch.uint8)
    with pytest.raises(ValueError):
        cpu_gguf.linear(torch.randn(1, 40), raw, cpu_gguf.TYPES["Q4_0"], 40)  # K % 32
