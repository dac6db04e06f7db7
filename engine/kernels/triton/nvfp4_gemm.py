"""FP4 weight-only GEMMs: y = x @ W.T with W [N, K] held as compressed-tensors stores it, e2m1
codes two a byte [N, K / 2] (value 2j in byte j's low nibble, 2j + 1 in its high) and
- NVFP4 (engine.layers.quantization.nvfp4): an e4m3 scale per 16 values and a float32 global
  scale per output row (a merged layer's parts each their own): W = value * (scale / global);
- MXFP4 (engine.layers.quantization.mxfp4_linear): an E8M0 byte per 32 values, a power of two
  (bias 127): W = value * 2 ** (scale - 127). Its global scale is 1;
- LUT4 (bitsandbytes' NF4 / FP4, engine.layers.quantization.bnb): the 4-bit codes index the
  checkpoint's 16 float32 levels, a float32 absmax per 64 values: W = levels[code] * absmax.

Weight-only: x stays in the model's dtype (bf16/fp16). A program takes a BLOCK_M x BLOCK_N
tile of y and walks K BLOCK_K inputs at a time: it loads BLOCK_K / 2 bytes of each of its
rows, multiplies the low nibbles' values by x's even columns and the high nibbles' by its odd
ones (two tl.dot, no interleave), each value decoded with integer ops and times its scale /
global scale in fp32 (dequantize_nvfp4's arithmetic, then rounded to x's dtype: the product is
W's dequantized value). The launch (tiles, split-K for decode-sized M) is
quant_gemm.plan_launch's, K tiles of at least 32 (16 bytes a row).

The weight stays 0.5625 bytes a value on the device (codes, scale bytes), against bf16's 2.
Not here: fp4 tensor-core dots (sm_100's, with x quantized to fp4: W4A4).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.fp8_block_gemm import _e4m3_value
from engine.kernels.triton.quant_gemm import (
    GemmLaunch,
    _dot_dtype,
    _num_sms,
    gemm_rows,
    plan_launch,
    reduce_splits,
    split_k_output,
)

GROUP = 16  # values an NVFP4 scale covers
MX_GROUP = 32  # values an MXFP4 (E8M0) scale covers
LUT_GROUP = 64  # values a LUT4 (bitsandbytes) absmax covers


@triton.jit
def _e2m1_value(c):
    """e2m1 codes (int32, 0..15: the sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6) -> fp32."""
    idx = c & 7
    normal = (((idx >> 1) + 126) << 23 | (idx & 1) << 22).to(tl.float32, bitcast=True)
    value = tl.where(idx < 2, idx.to(tl.float32) * 0.5, normal)  # 2^(e - 1) (1 + m / 2)
    return tl.where((c & 8) != 0, -value, value)


@triton.jit
def _e8m0_value(b):
    """E8M0 bytes (int32, 0..254) -> 2 ** (b - 127) in fp32 (byte 0: 2^-127, a subnormal)."""
    return tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    t_ptr,  # LUT4's 16 levels (unread by the FP4 kinds)
    out_ptr,
    M,
    N,
    K,
    tiles_per_split,
    stride_xm,
    stride_wn,
    stride_sg,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    HALF: tl.constexpr,  # BLOCK_K // 2: bytes of a row a K tile reads
    SCALE_GROUP: tl.constexpr,  # values a scale covers: 16 (NVFP4), 32 (MXFP4), 64 (LUT4)
    KIND: tl.constexpr,  # 0: NVFP4 (e4m3 scales / global), 1: MXFP4 (E8M0), 2: LUT4 (float32)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    gs = tl.load(g_ptr + offs_n, mask=n_ok, other=1.0)[None, :]  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * tiles_per_split
    for t in range(0, tiles_per_split):
        offs_j = (first + t) * HALF + tl.arange(0, HALF)  # bytes along K / 2
        j_ok = offs_j < K // 2
        x_rows = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_j[None, :]
        x_mask = m_ok[:, None] & j_ok[None, :]
        x_even = tl.load(x_rows, mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + 1, mask=x_mask, other=0.0)
        w_mask = j_ok[:, None] & n_ok[None, :]
        q = tl.load(w_rows + offs_j[:, None], mask=w_mask, other=0).to(tl.int32)  # [HALF, BN]
        groups = (2 * offs_j) // SCALE_GROUP  # a byte's two values share their group
        sb = tl.load(s_ptr + groups[:, None] * stride_sg + offs_n[None, :], mask=w_mask, other=0)
        if KIND == 2:  # the levels times the absmax in fp32, as bitsandbytes dequantizes
            w_lo = tl.load(t_ptr + (q & 15)) * sb  # 0 outside K and N (their absmax is 0)
            w_hi = tl.load(t_ptr + (q >> 4)) * sb
        else:
            if KIND == 1:
                s = _e8m0_value(sb.to(tl.int32))  # exact: a power of two
            else:
                s = tl.div_rn(_e4m3_value(sb), gs)  # scale / global scale, as dequantize_nvfp4
            w_lo = _e2m1_value(q & 15) * s  # 0 outside K and N
            w_hi = _e2m1_value(q >> 4) * s
        if DOT_IEEE:
            acc += tl.dot(x_even.to(tl.float32), w_lo, input_precision="ieee")
            acc += tl.dot(x_odd.to(tl.float32), w_hi, input_precision="ieee")
        else:
            wt = x_ptr.dtype.element_ty
            acc += tl.dot(x_even.to(DOT_DTYPE), w_lo.to(wt).to(DOT_DTYPE))
            acc += tl.dot(x_odd.to(DOT_DTYPE), w_hi.to(wt).to(DOT_DTYPE))
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(slots=True)
class NvFp4Weight:
    """One linear's NVFP4 weight as the kernel reads it: `packed` uint8 [N, K / 2] (the
    checkpoint's bytes), `scales` uint8 [K / 16, N] (the e4m3 scale bytes, group-major: a tile's
    scales are contiguous rows), `global_scale` float32 [N]. (MxFp4Weight: the MXFP4 form.)"""

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    group = GROUP
    kind = 0  # the kernel's KIND

    @property
    def levels(self) -> torch.Tensor:
        """The table LUT4 reads (the FP4 kinds pass their global scales, unread)."""
        return self.global_scale

    @classmethod
    def prepare(cls, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
        """packed uint8 [N, K / 2], scale float8_e4m3fn [N, K / 16], global_scale float32 [N]."""
        n, half = packed.shape
        if half * 2 % GROUP or scale.shape != (n, half * 2 // GROUP) or global_scale.numel() != n:
            raise ValueError(
                f"NVFP4 codes {tuple(packed.shape)}, scales {tuple(scale.shape)} and global "
                f"scales {tuple(global_scale.shape)} do not pair (expected [{n}, K / 2], "
                f"[{n}, K / 16], [{n}] with K a multiple of 16)"
            )
        scales = scale.view(torch.uint8).t().contiguous()
        return cls(packed.contiguous(), scales, global_scale.float().reshape(n).contiguous())

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2


@dataclass(slots=True)
class MxFp4Weight(NvFp4Weight):
    """One linear's MXFP4 weight as the kernel reads it: `packed` uint8 [N, K / 2], `scales`
    uint8 [K / 32, N] (the E8M0 bytes, group-major), `global_scale` ones [N] (unread)."""

    group = MX_GROUP
    kind = 1

    @classmethod
    def prepare(cls, packed: torch.Tensor, scale: torch.Tensor, global_scale=None):
        """packed uint8 [N, K / 2], scale uint8 [N, K / 32] (E8M0)."""
        n, half = packed.shape
        if half * 2 % MX_GROUP or scale.shape != (n, half * 2 // MX_GROUP):
            raise ValueError(
                f"MXFP4 codes {tuple(packed.shape)} and scales {tuple(scale.shape)} do not pair "
                f"(expected [{n}, K / 2] and [{n}, K / 32] with K a multiple of 32)"
            )
        ones = torch.ones(n, dtype=torch.float32, device=packed.device)
        return cls(packed.contiguous(), scale.t().contiguous(), ones)


@dataclass(slots=True)
class Lut4Weight(NvFp4Weight):
    """One linear's bitsandbytes 4-bit weight as the kernel reads it: `packed` uint8 [N, K / 2]
    (value 2j in byte j's low nibble, as the FP4 kinds), `scales` float32 [K / 64, N] (absmax,
    group-major), `global_scale` ones [N] (unread), `table` float32 [16] (the levels)."""

    table: torch.Tensor
    group = LUT_GROUP
    kind = 2

    @classmethod
    def prepare(cls, codes: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor):
        """codes uint8 [N, K] (0..15), scales float32 [N, K / 64], levels float32 [16]."""
        n, k = codes.shape
        if k % LUT_GROUP or scales.shape != (n, k // LUT_GROUP) or levels.numel() != 16:
            raise ValueError(
                f"LUT4 codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and levels "
                f"{tuple(levels.shape)} do not pair (expected [{n}, K], [{n}, K / 64], [16] with "
                "K a multiple of 64)"
            )
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        ones = torch.ones(n, dtype=torch.float32, device=codes.device)
        return cls(packed.contiguous(), scales.float().t().contiguous(), ones,
                   levels.float().reshape(16).contiguous())  # fmt: skip

    @property
    def levels(self) -> torch.Tensor:
        return self.table


def nvfp4_gemm(
    x: torch.Tensor,
    weight: NvFp4Weight | MxFp4Weight | Lut4Weight,
    *,
    split_k: int | None = None,
    launch: GemmLaunch | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T in x's dtype (bf16 / fp16; fp32 works too), W an NVFP4 or
    MXFP4 weight, or bitsandbytes' 4-bit (LUT4). split_k / launch override the planned launch (tests, benchmarks)."""
    n, k = weight.out_features, weight.in_features
    x2, y, lead = gemm_rows(x, k, n)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if launch is None:
        launch = plan_launch(m, n, k, 64, False, _num_sms(x.device))
    if launch.block_k < 32:  # two dots of BLOCK_K / 2: tl.dot's 16 at least
        launch = dataclasses.replace(launch, block_k=32)
    split, tiles_per_split, out = split_k_output(launch, split_k, k, y)
    dot = _dot_dtype(x.dtype, x.device)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)
    _nvfp4_gemm_kernel[grid](
        x2, weight.packed, weight.scales, weight.global_scale, weight.levels, out,
        m, n, k, tiles_per_split,
        x2.stride(0), weight.packed.stride(0), weight.scales.stride(0),
        out.stride(-2), out.stride(0) if split > 1 else 0,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        DOT_DTYPE=dot,
        DOT_IEEE=dot == tl.float32,
        HALF=launch.block_k // 2,
        SCALE_GROUP=weight.group,
        KIND=weight.kind,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    reduce_splits(out, y)
    return y.reshape(*lead, n)
