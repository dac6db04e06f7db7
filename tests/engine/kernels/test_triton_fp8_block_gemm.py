"""The block-FP8 Triton GEMM (engine/kernels/triton/fp8_block_gemm.py) against dequantize-then-
matmul (engine.kernels.fp8.dequantize_fp8_blocks, then F.linear in fp32): odd M, N and K not
multiples of the block (partial last blocks), M = 1 and larger, split-K, blocks smaller and
larger than the kernel's K tile, and every e4m3 byte decoded exactly.

Without a GPU the kernel runs under Triton's interpreter on CPU tensors (tests/engine/
conftest.py), where bf16 takes fp32 dots and the output cast truncates; on a GPU (benchmarks/
gpu_session.sh) the same tests run it compiled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from engine.kernels.fp8 import dequantize_fp8_blocks, expand_block_scales  # noqa: E402
from engine.kernels.triton.fp8_block_gemm import Fp8BlockWeight, fp8_block_gemm  # noqa: E402
from engine.kernels.triton.quant_gemm import GemmLaunch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# max|y - ref| / max|ref|: x and y rounded to the model dtype (the interpreter's bf16 path
# multiplies W unrounded and truncates y)
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _weight(n: int, k: int, block: tuple[int, int], seed: int):
    """Random e4m3 bytes [N, K] and block scales [ceil(N/bn), ceil(K/bk)] -> (the kernel's
    weight, the fp32 dequantized W [N, K] computed here block by block)."""
    gen = torch.Generator().manual_seed(seed)
    bn, bk = block
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // bn), -(-k // bk), generator=gen) * 1e-3 + 1e-4
    w = torch.empty(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            w[rows, cols] = q[rows, cols].float() * scales[i, j]
    rows = expand_block_scales(scales, n, bn)
    assert torch.equal(dequantize_fp8_blocks(q, rows, bk, torch.float32), w)
    return Fp8BlockWeight.prepare(q.to(DEVICE), rows.to(DEVICE), bk), w


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype) -> None:
    want = F.linear(x.float(), w.to(dtype).float())  # W rounded to the model dtype once
    err = (got.float().cpu() - want).abs().max()
    assert err <= REL_TOL[dtype] * want.abs().max(), float(err / want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [
        (1, 200, 300, (128, 128)),  # decode, partial last blocks on N and K
        (7, 96, 256, (128, 128)),  # N inside one partial block
        (33, 130, 192, (48, 32)),  # a block smaller than the K tile: scales per k
        (70, 64, 100, (16, 48)),  # K tile and block unaligned, M over one tile
    ],
)
def test_the_gemm_matches_dequantize_then_matmul(m, n, k, block, dtype):
    weight, w = _weight(n, k, block, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = fp8_block_gemm(x.to(DEVICE), weight)
    assert got.shape == (m, n) and got.dtype == dtype
    _check(got, x, w, dtype)


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_sums_the_partials(split_k):
    weight, w = _weight(64, 512, (128, 128), seed=split_k)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    launch = GemmLaunch(16, 32, 64, split_k, 4, 2)
    _check(fp8_block_gemm(x.to(DEVICE), weight, launch=launch), x, w, torch.float16)


def test_every_e4m3_byte_decodes_exactly():
    """One-hot rows of x read W's columns back: all 256 bytes (but the two NaNs), scale 1."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(-1, 2)  # [127, 2]: N = 127, K = 2
    q = codes.view(torch.float8_e4m3fn)
    weight = Fp8BlockWeight.prepare(q.to(DEVICE), torch.ones(q.shape[0], 1, device=DEVICE), 128)
    got = fp8_block_gemm(torch.eye(2, device=DEVICE), weight).t().cpu()
    assert torch.equal(got, q.float())


def test_a_batched_input_keeps_its_leading_dims_and_zero_rows_work():
    weight, w = _weight(48, 64, (32, 32), seed=5)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    got = fp8_block_gemm(x.to(DEVICE), weight)
    assert got.shape == (2, 3, 48)
    _check(got.reshape(6, 48), x.reshape(6, 64), w, torch.float32)
    assert fp8_block_gemm(torch.zeros(0, 64, device=DEVICE), weight).shape == (0, 48)


def test_scales_of_the_wrong_shape_are_refused():
    q = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected \[8, 1\]"):
        Fp8BlockWeight.prepare(q, torch.ones(8, 2), 128)
