"""Block-FP8 GEMM: y = x @ W.T with W [N, K] held as float8 e4m3 bytes and one float32 scale
per (output row, block of block_k inputs): the form block-wise FP8 checkpoints load into
(engine.layers.quantization.fp8_block; their [block_n, block_k] scale blocks expanded to one
row of scales per output row at load, engine.kernels.fp8.expand_block_scales).

Weight-only: x stays in the model's dtype (bf16/fp16). A program takes a BLOCK_M x BLOCK_N
tile of y and walks K BLOCK_K inputs at a time: it loads the weight bytes of its tile, decodes
them to fp32 with integer ops (e4m3 has no hardware conversion before sm_89, and this is also
what Triton's interpreter computes exactly), multiplies by the scales in fp32, rounds to x's
dtype (the same rounding as dequantize_fp8_blocks, so the product is W's dequantized value)
and feeds tl.dot with fp32 accumulation. Where block_k is a multiple of BLOCK_K one row of
scales is loaded per tile, else one per k (a partial last block of K works either way).
The launch (tiles, split-K for decode-sized M) is quant_gemm.plan_launch's, with the block as
the group: the same shapes as the W8A16 kernel, which reads as many weight bytes.

The weight stays 1 byte a value on the device (plus 4 / block_k bytes of scales a value):
half of bf16's memory. Not here: W8A8 (x quantized per token group and an fp8 tl.dot on
sm_89+, vLLM's w8a8_block_fp8_matmul), which would be faster for prefill.

e4m3fn's NaN bytes (0x7F, 0xFF) decode as +-480: a checkpoint holds none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.quant_gemm import (
    GemmLaunch,
    _dot_dtype,
    _num_sms,
    gemm_rows,
    plan_launch,
    reduce_splits,
    split_k_output,
)


@triton.jit
def _e4m3_value(b):
    """float8 e4m3fn bytes (any int type) -> their fp32 values, exactly (no denormal fp32)."""
    b = b.to(tl.int32) & 0xFF
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) (1 + m/8)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((b & 0x80) != 0, -value, value)


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    scale_block_k,
    tiles_per_split,
    stride_xm,
    stride_wn,
    stride_sg,
    stride_om,
    stride_os,
    SCALE_PER_TILE: tl.constexpr,  # every K tile lies in one scale block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * tiles_per_split
    for t in range(0, tiles_per_split):
        k0 = (first + t) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wk_ok = k_ok[:, None] & n_ok[None, :]
        q = tl.load(w_rows + offs_k[:, None], mask=wk_ok, other=0)  # [BLOCK_K, BLOCK_N] bytes
        if SCALE_PER_TILE:
            g = tl.minimum(k0, K - 1) // scale_block_k  # a split's last tiles may lie past K
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0)[None, :]
        else:
            g = offs_k // scale_block_k
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=wk_ok, other=0.0)
        w = _e4m3_value(q) * s  # 0 outside K and N
        if DOT_IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x.to(DOT_DTYPE), w.to(x_ptr.dtype.element_ty).to(DOT_DTYPE))
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(slots=True)
class Fp8BlockWeight:
    """One linear's block-FP8 weight as the kernel reads it: `data` uint8 [N, K] (the e4m3
    bytes), `scales` float32 [ceil(K / block_k), N] (K-block-major: a tile's scales are one
    contiguous row), `block_k` the inputs a scale covers."""

    data: torch.Tensor
    scales: torch.Tensor
    block_k: int

    @classmethod
    def prepare(cls, w_fp8: torch.Tensor, row_scales: torch.Tensor, block_k: int):
        """w_fp8 float8_e4m3fn [N, K], row_scales float32 [N, ceil(K / block_k)]."""
        n, k = w_fp8.shape
        if row_scales.shape != (n, -(-k // block_k)):
            raise ValueError(
                f"scales of {tuple(row_scales.shape)} for a [{n}, {k}] weight in blocks of "
                f"{block_k} inputs: expected [{n}, {-(-k // block_k)}]"
            )
        data = w_fp8.contiguous().view(torch.uint8)
        return cls(data, row_scales.float().t().contiguous(), int(block_k))

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1]


def fp8_block_gemm(
    x: torch.Tensor,
    weight: Fp8BlockWeight,
    *,
    split_k: int | None = None,
    launch: GemmLaunch | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T in x's dtype (bf16 / fp16; fp32 works too). split_k /
    launch override the planned launch (tests, benchmarks)."""
    n, k = weight.data.shape
    x2, y, lead = gemm_rows(x, k, n)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    bk = weight.block_k
    if launch is None:
        launch = plan_launch(m, n, k, bk, False, _num_sms(x.device))
    split, tiles_per_split, out = split_k_output(launch, split_k, k, y)
    dot = _dot_dtype(x.dtype, x.device)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)
    _fp8_block_gemm_kernel[grid](
        x2, weight.data, weight.scales, out,
        m, n, k, bk, tiles_per_split,
        x2.stride(0), weight.data.stride(0), weight.scales.stride(0),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        SCALE_PER_TILE=bk % launch.block_k == 0 or bk >= k,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        DOT_DTYPE=dot,
        DOT_IEEE=dot == tl.float32,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    reduce_splits(out, y)
    return y.reshape(*lead, n)
