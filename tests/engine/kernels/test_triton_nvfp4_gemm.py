"""The NVFP4 weight-only Triton GEMM (engine/kernels/triton/nvfp4_gemm.py) against
dequantize-then-matmul (engine.layers.quantization.nvfp4.dequantize_nvfp4, then F.linear in
fp32): odd M and N, K with a last tile of 16 values, M = 1 and larger, split-K, per-row global
scales, and every e2m1 code and e4m3 scale byte decoded exactly; the MXFP4 form (an E8M0 power
of two per 32 values) likewise; and LUT4 (bitsandbytes' NF4 / FP4: a float32 table of 16 levels,
a float32 absmax per 64 values) against engine.layers.quantization.bnb's dequantization.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (tests/engine/
conftest.py); on a GPU (benchmarks/gpu_session.sh) the same tests run it compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.kernels.triton.nvfp4_gemm import (  # noqa: E402
    Lut4Weight,
    MxFp4Weight,
    NvFp4Weight,
    nvfp4_gemm,
)
from engine.kernels.triton.quant_gemm import GemmLaunch  # noqa: E402
from engine.layers.quantization.mxfp4_blocks import dequantize_mxfp4  # noqa: E402
from engine.layers.quantization.nvfp4 import dequantize_nvfp4  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _weight(n: int, k: int, seed: int):
    """Random codes, scale bytes (finite, non-negative) and global scales -> (the kernel's
    weight, the fp32 dequantized W [N, K])."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8)
    scale = scale.view(torch.float8_e4m3fn)
    g = torch.rand(n, generator=gen) * 1000 + 10
    w = dequantize_nvfp4(packed, scale, g, torch.float32)
    return NvFp4Weight.prepare(packed.to(DEVICE), scale.to(DEVICE), g.to(DEVICE)), w


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype) -> None:
    want = F.linear(x.float(), w.to(dtype).float())  # W rounded to the model dtype once
    err = (got.float().cpu() - want).abs().max()
    assert err <= REL_TOL[dtype] * want.abs().max(), float(err / want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 200, 320), (7, 96, 256), (33, 130, 48), (70, 64, 112)],  # K % 32 == 16: a half tile
)
def test_the_gemm_matches_dequantize_then_matmul(m, n, k, dtype):
    weight, w = _weight(n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = nvfp4_gemm(x.to(DEVICE), weight)
    assert got.shape == (m, n) and got.dtype == dtype
    _check(got, x, w, dtype)


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_sums_the_partials(split_k):
    weight, w = _weight(64, 512, seed=split_k)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    launch = GemmLaunch(16, 32, 64, split_k, 4, 2)
    _check(nvfp4_gemm(x.to(DEVICE), weight, launch=launch), x, w, torch.float16)


def test_every_code_and_scale_byte_decodes_exactly():
    """One-hot rows of x read W's columns back, in float32: each of the 16 codes in both
    nibbles under each of the 127 non-NaN scale bytes, global scale 1."""
    scale_bytes = torch.arange(127, dtype=torch.uint8)  # 0x00..0x7E
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes.flip(0) << 4)).repeat(127, 1)  # [127, 16]: K = 32
    scale = scale_bytes[:, None].repeat(1, 2).view(torch.float8_e4m3fn)  # [127, 2]
    weight = NvFp4Weight.prepare(
        packed.to(DEVICE), scale.to(DEVICE), torch.ones(127, device=DEVICE)
    )
    got = nvfp4_gemm(torch.eye(32, device=DEVICE), weight).t().cpu()
    assert torch.equal(got, dequantize_nvfp4(packed, scale, torch.ones(127), torch.float32))


def test_a_batched_input_keeps_its_leading_dims_and_zero_rows_work():
    weight, w = _weight(48, 64, seed=5)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    got = nvfp4_gemm(x.to(DEVICE), weight)
    assert got.shape == (2, 3, 48)
    _check(got.reshape(6, 48), x.reshape(6, 64), w, torch.float32)
    assert nvfp4_gemm(torch.zeros(0, 64, device=DEVICE), weight).shape == (0, 48)


def test_tensors_that_do_not_pair_are_refused():
    with pytest.raises(ValueError, match=r"do not pair"):
        NvFp4Weight.prepare(torch.zeros(8, 32, dtype=torch.uint8),
                            torch.zeros(8, 2, dtype=torch.float8_e4m3fn), torch.ones(8))  # fmt: skip


# -- MXFP4: the same kernel with an E8M0 power of two per 32 values -----------------------------


def _mx_weight(n: int, k: int, seed: int):
    """Random codes and E8M0 bytes (near 2^0, every power within reach of fp32 sums) -> (the
    kernel's weight, the fp32 dequantized W [N, K])."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(117, 137, (n, k // 32), generator=gen, dtype=torch.uint8)
    w = dequantize_mxfp4(packed.view(n, -1, 16), scale, torch.float32).reshape(n, k)
    return MxFp4Weight.prepare(packed.to(DEVICE), scale.to(DEVICE)), w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 320), (33, 130, 96), (70, 64, 224)])
def test_mxfp4_matches_dequantize_then_matmul(m, n, k, dtype):
    _check_launches(*_mx_weight(n, k, seed=m + n), m, dtype)


def _check_launches(weight, w: torch.Tensor, m: int, dtype) -> None:
    """m random rows against the weight (W its fp32 dequantized value): the planned launch and
    a split-K one (partial sums)."""
    n, k = w.shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = nvfp4_gemm(x.to(DEVICE), weight)
    assert got.shape == (m, n) and got.dtype == dtype
    _check(got, x, w, dtype)
    launch = GemmLaunch(16, 32, 64, 3, 4, 2)  # split-K: partial sums
    _check(nvfp4_gemm(x.to(DEVICE), weight, launch=launch), x, w, dtype)


def test_every_mxfp4_code_and_scale_byte_decodes_exactly():
    """One-hot rows of x read W's columns back, in float32: each of the 16 codes in both
    nibbles under each E8M0 byte 0..252 (byte 0: 2^-127, a subnormal; above 252 six times the
    scale overflows fp32, and a one-hot row's zeros times inf are NaN in any GEMM)."""
    rows = 253
    scale_bytes = torch.arange(rows, dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes.flip(0) << 4)).repeat(rows, 1)  # [rows, 16]: K = 32
    scale = scale_bytes[:, None]  # [rows, 1]
    weight = MxFp4Weight.prepare(packed.to(DEVICE), scale.to(DEVICE))
    got = nvfp4_gemm(torch.eye(32, device=DEVICE), weight).t().cpu()
    want = dequantize_mxfp4(packed.view(rows, 1, 16), scale, torch.float32).reshape(rows, 32)
    assert torch.equal(got, want)


def test_mxfp4_shapes_that_do_not_pair_are_refused():
    with pytest.raises(ValueError, match="MXFP4 codes .* do not pair"):
        MxFp4Weight.prepare(
            torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
        )


# -- LUT4 (bitsandbytes' NF4 / FP4) --------------------------------------------------------------

NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])  # fmt: skip


def _lut_weight(n: int, k: int, seed: int):
    """Random codes and absmax per 64 -> (the kernel's weight, W = NF4[code] * absmax in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    absmax = torch.rand(n, k // 64, generator=gen) * 2 + 0.01
    w = (NF4[codes.long()].view(n, k // 64, 64) * absmax.unsqueeze(-1)).view(n, k)
    weight = Lut4Weight.prepare(codes.to(DEVICE), absmax.to(DEVICE), NF4.to(DEVICE))
    return weight, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 320), (33, 130, 128), (70, 64, 192)])
def test_lut4_matches_dequantize_then_matmul(m, n, k, dtype):
    _check_launches(*_lut_weight(n, k, seed=m + n), m, dtype)


def test_every_lut4_code_decodes_exactly():
    """One-hot rows of x read W's columns back in float32: each of the 16 codes in both
    nibbles, times each row's absmax, is the table's value times it (bitsandbytes' product)."""
    rows, k = 8, 64
    codes = torch.arange(16, dtype=torch.uint8).repeat(rows, k // 16)
    codes[1::2] = codes[1::2].flip(1)  # odd rows: the codes in the other nibbles
    absmax = torch.rand(rows, 1, generator=torch.Generator().manual_seed(0)) + 0.5
    weight = Lut4Weight.prepare(codes.to(DEVICE), absmax.to(DEVICE), NF4.to(DEVICE))
    got = nvfp4_gemm(torch.eye(k, device=DEVICE), weight).t().cpu()
    assert torch.equal(got, NF4[codes.long()] * absmax)


def test_lut4_shapes_that_do_not_pair_are_refused():
    with pytest.raises(ValueError, match="LUT4 codes .* do not pair"):
        Lut4Weight.prepare(torch.zeros(4, 96, dtype=torch.uint8), torch.zeros(4, 1), NF4)
