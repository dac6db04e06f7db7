"""W4A16 / W8A16 GEMM: y = x @ W with W held as packed integers, dequantized in the inner loop.

The weight is in the one canonical GPTQ-style form every integer weight-only format (AWQ,
GPTQ, compressed-tensors pack-quantized) is converted to at load:

    qweight  int32 [K // (32 // bits), N]  packed along K (the input dim), the lowest bits of
                                           a word the lowest k: q[k, n] = (qweight[k // P, n]
                                           >> (k % P) * bits) & (2**bits - 1), P = 32 // bits
    scales   fp16/bf16 [G, N]              G = K // group_size (1 for channel-wise)
    zeros    int32 [G, N] or None          unpacked zero points; None: symmetric, 2**(bits-1)
    g_idx    int32 [K] or None             the group of each input row (act-order / desc_act);
                                           None: k // group_size
    W[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]

bits is 4 or 8, group_size a positive divisor of K or -1 (one group: per channel), K a
multiple of 8 (4 for 8 bits). N is free.

One kernel for every shape: a program takes a BLOCK_M x BLOCK_N tile of y and walks K
BLOCK_K rows at a time: it loads the packed words of its rows ([BLOCK_K / P, BLOCK_N], each
word once, spread into its P values by a broadcast shift and a reshape; or, the `gather`
alternative, one load a value, AutoGPTQ's Triton form, which the reshape falls back to should
it not compile), masks out the integers, subtracts the zero points, multiplies by the scales in
fp32, and feeds the weights in the activations' dtype to tl.dot with fp32 accumulation.
Decode-sized batches (M <= 16) take BLOCK_M = 16 (tl.dot's smallest) and split K across
programs (split-K): with only N / BLOCK_N tiles of y the GPU would be mostly idle, so each
split writes an fp32 partial and torch sums them (plan_launch splits until there are two
programs an SM, at any M). Larger M take 32/64 x 64 tiles, prefill 64 x 128. The tiles are
first guesses, not measured: benchmarks/gpu_quant.py --sweep times the alternatives.

Scales and zeros: where a K tile lies in one group (group_size a multiple of BLOCK_K, or one
group), one row of them is loaded per tile; otherwise (g_idx, or small groups) one row per k,
gathered through g(k).

Act-order: `repack_for_kernel` (once, at load) sorts the rows of K by group, as exllama and
vLLM do: the integers are unpacked, permuted and packed again, g_idx becomes the plain
k // group_size (and is dropped), and the permutation is kept: the kernel reads x's columns
through it (x[:, perm] gathered in the load, no extra launch), so the scales are loaded once
per tile again. Without the repack, w_int_gemm takes g_idx directly and gathers a scale row
per k: correct, slower.

Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (the tests): there bf16 activations
take an fp32 dot (the interpreter's bf16 arithmetic is broken) and the fp32 -> bf16 cast of
the output truncates, so bf16 results are within an ulp of the rounded ones.
`dequantize_reference` is the torch form of the same weights: the reference the tests hold
the kernel to, and a CPU fallback (dequantize, then a dense matmul).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DECODE_M = 16  # up to this many rows: a decode tile (BLOCK_M = 16) with split-K
MAX_SPLIT_K = 16
_RESHAPE_FAILED: list[str] = []  # why the reshape unpack failed to compile, once it has


@triton.jit
def _w_int_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    perm_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    tiles_per_split,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_om,
    stride_os,
    BITS: tl.constexpr,
    PACK: tl.constexpr,  # 32 // BITS values a word
    MASK: tl.constexpr,  # 2**BITS - 1
    HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_PERM: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,  # every K tile lies in one group: one scale row a tile
    UNPACK_RESHAPE: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * tiles_per_split
    for t in range(0, tiles_per_split):
        k0 = (first + t) * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_PERM:  # act-order repacked: row k of the weight is column perm[k] of x
            x_cols = tl.load(perm_ptr + offs_k, mask=k_ok, other=0)
        else:
            x_cols = offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + x_cols[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wk_ok = k_ok[:, None] & n_ok[None, :]
        # (an arithmetic shift of a negative word: the mask drops the copied sign bits)
        if UNPACK_RESHAPE:  # each word loaded once, its PACK values spread by a reshape
            offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            packed = tl.load(
                qw_ptr + offs_w[:, None] * stride_qk + offs_n[None, :],
                mask=(offs_w[:, None] < K // PACK) & n_ok[None, :],
                other=0,
            )
            shifts = tl.arange(0, PACK) * BITS
            q = (packed[:, None, :] >> shifts[None, :, None]) & MASK  # [BK / PACK, PACK, BN]
            q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        else:  # each word loaded once per value it holds (the same cache line PACK times)
            packed = tl.load(
                qw_ptr + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :],
                mask=wk_ok,
                other=0,
            )
            q = (packed >> ((offs_k % PACK) * BITS)[:, None]) & MASK
        if GROUP_PER_TILE:
            g = tl.minimum(k0, K - 1) // group_size  # a split's last tiles may lie past K
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            s = s[None, :]
            if HAS_ZEROS:
                z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_ok, other=0)[None, :]
            else:
                z = 1 << (BITS - 1)
        else:
            if HAS_G_IDX:
                g = tl.load(g_ptr + offs_k, mask=k_ok, other=0)
            else:
                g = offs_k // group_size
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=wk_ok, other=0.0)
            s = s.to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=wk_ok, other=0)
            else:
                z = 1 << (BITS - 1)
        w = (q - z).to(tl.float32) * s  # [BLOCK_K, BLOCK_N]; 0 outside K and N
        if DOT_IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE))
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(slots=True)
class QuantGemmWeight:
    """One linear's weight as the kernel reads it (see the module's docstring); perm: int32
    [K], the column of x each weight row multiplies (act-order repacked), or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


@dataclass(slots=True, frozen=True)
class GemmLaunch:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    # "reshape": a tile's packed words loaded once each and unpacked by a broadcast shift and
    # a reshape; "gather": one load a value (AutoGPTQ's Triton form: each word PACK times)
    unpack: str = "reshape"


def _check(qweight, scales, zeros, g_idx, bits, group_size) -> tuple[int, int, int]:
    """-> (K, N, group_size) with -1 resolved to K; raises ValueError on a wrong layout."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError("qweight must be int32 [K // (32 // bits), N]")
    k = qweight.shape[0] * (32 // bits)
    n = qweight.shape[1]
    group_size = k if group_size is None or group_size <= 0 else int(group_size)
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")
    groups = k // group_size
    if scales.shape != (groups, n):
        raise ValueError(f"scales must be [{groups}, {n}], not {list(scales.shape)}")
    if zeros is not None and zeros.shape != (groups, n):
        raise ValueError(f"zeros must be [{groups}, {n}], not {list(zeros.shape)}")
    if g_idx is not None and g_idx.shape != (k,):
        raise ValueError(f"g_idx must be [{k}], not {list(g_idx.shape)}")
    return k, n, group_size


def unpack_int(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K / P, N] packed along K -> int32 [K, N] of values in [0, 2**bits)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    q = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return q.reshape(-1, qweight.shape[1])


def pack_int(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int [K, N] of values in [0, 2**bits) -> int32 [K / P, N], the lowest k in the lowest
    bits (the inverse of unpack_int)."""
    pack = 32 // bits
    k, n = q.shape
    assert k % pack == 0
    q = q.to(torch.int64).reshape(k // pack, pack, n)
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits
    words = (q << shifts[None, :, None]).sum(dim=1)
    # two's complement into int32 (the top nibble may set the sign bit)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_reference(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """The weight W [K, N] in fp32, in torch: (q - zero[g(k)]) * scale[g(k)]."""
    k, _, group_size = _check(qweight, scales, zeros, g_idx, bits, group_size)
    q = unpack_int(qweight, bits)
    g = (
        torch.arange(k, device=q.device) // group_size
        if g_idx is None
        else g_idx.to(device=q.device, dtype=torch.long)
    )
    z = 1 << (bits - 1) if zeros is None else zeros[g].to(torch.int32)
    return (q - z).to(torch.float32) * scales[g].to(torch.float32)


def repack_for_kernel(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> QuantGemmWeight:
    """Once, at load: the canonical form as the kernel reads it best. Without act-order the
    tensors only become contiguous (g_idx dropped where it is the plain k // group_size);
    with it, the rows of K are sorted by group (a stable sort), qweight packed again in that
    order, and perm keeps which column of x each sorted row multiplies."""
    k, _, group_size = _check(qweight, scales, zeros, g_idx, bits, group_size)
    qweight = qweight.contiguous()
    scales = scales.contiguous()
    zeros = None if zeros is None else zeros.to(torch.int32).contiguous()
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(device=qweight.device, dtype=torch.int32)
        plain = torch.arange(k, device=g_idx.device, dtype=torch.int32) // group_size
        if torch.equal(g_idx, plain):
            g_idx = None
        else:
            order = torch.argsort(g_idx, stable=True)
            qweight = pack_int(unpack_int(qweight, bits)[order], bits)
            g_idx = g_idx[order].contiguous()
            perm = order.to(torch.int32).contiguous()
            if torch.equal(g_idx, plain):  # every group group_size rows: the usual case
                g_idx = None
    return QuantGemmWeight(qweight, scales, zeros, g_idx, perm, bits, group_size)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return _cuda_sms(index)
    return 1  # the interpreter: as few programs as can be


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=4096)  # called on every GEMM: the hot path's host time
def plan_launch(
    m: int, n: int, k: int, group_size: int, per_k_groups: bool, sms: int
) -> GemmLaunch:
    """Tiles for y [m, n] over K = k. per_k_groups: scales gathered per row (g_idx kept)."""
    # BLOCK_K: a divisor of the group where one can be (one scale row a tile), 16..128
    block_k = 64
    if not per_k_groups:
        if group_size >= k:
            block_k = 128
        else:
            for bk in (128, 64, 32, 16):
                if group_size % bk == 0:
                    block_k = bk
                    break
    if m <= DECODE_M:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    else:  # (BLOCK_K at most 64: the pipelined stages of the loads fit in shared memory)
        block_m, block_n, warps, stages = (32 if m <= 32 else 64), 64, 4, 4
        if m > 64:
            block_n, stages = 128, 3
        block_k = min(block_k, 64)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    k_tiles = triton.cdiv(k, block_k)
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # split K until there are two programs an SM (each keeping at least 4 K tiles)
    split = 1
    while split < MAX_SPLIT_K and tiles * split < 2 * sms and k_tiles >= 8 * split:
        split *= 2
    return GemmLaunch(block_m, block_n, block_k, split, warps, stages)


def _dot_dtype(dtype: torch.dtype, device: torch.device):
    if dtype == torch.float32 or (dtype == torch.bfloat16 and device.type == "cpu"):
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def w_int_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    *,
    perm: torch.Tensor | None = None,
    split_k: int | None = None,
    launch: GemmLaunch | None = None,
    unpack: str | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W, W in the canonical packed form (module docstring), in x's
    dtype (fp16/bf16; fp32 works too). perm: from repack_for_kernel (row k of the weight
    multiplies x[:, perm[k]]). split_k / launch / unpack ("reshape" | "gather"): override
    the planned launch (tests, benchmarks)."""
    k, n, group_size = _check(qweight, scales, zeros, g_idx, bits, group_size)
    x2, y, lead = gemm_rows(x, k, n)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    assert qweight.stride(-1) == 1 and scales.stride(-1) == 1
    assert zeros is None or zeros.stride(-1) == 1
    if launch is None:
        launch = plan_launch(m, n, k, group_size, g_idx is not None, _num_sms(x.device))
    split, tiles_per_split, out = split_k_output(launch, split_k, k, y)
    group_per_tile = g_idx is None and (group_size % launch.block_k == 0 or group_size >= k)
    dot = _dot_dtype(x.dtype, x.device)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), split)

    def run(unpack: str) -> None:
        _w_int_gemm_kernel[grid](
            x2, qweight, scales,
            qweight if zeros is None else zeros,  # unread without zeros
            qweight if g_idx is None else g_idx,
            qweight if perm is None else perm,
            out,
            m, n, k, group_size, tiles_per_split,
            x2.stride(0), qweight.stride(0), scales.stride(0),
            0 if zeros is None else zeros.stride(0),
            out.stride(-2), out.stride(0) if split > 1 else 0,
            BITS=bits,
            PACK=32 // bits,
            MASK=(1 << bits) - 1,
            HAS_ZEROS=zeros is not None,
            HAS_G_IDX=g_idx is not None,
            HAS_PERM=perm is not None,
            GROUP_PER_TILE=group_per_tile,
            UNPACK_RESHAPE=unpack == "reshape",
            BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n,
            BLOCK_K=launch.block_k,
            DOT_DTYPE=dot,
            DOT_IEEE=dot == tl.float32,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )  # fmt: skip

    unpack = unpack or launch.unpack
    if unpack == "reshape" and _RESHAPE_FAILED:
        unpack = "gather"
    try:
        run(unpack)
    except Exception as e:  # the reshape form failed to compile on this GPU / Triton: the other
        if unpack != "reshape" or x.device.type != "cuda":
            raise
        _RESHAPE_FAILED.append(f"{type(e).__name__}: {e}")
        warnings.warn(
            f"quant_gemm: the reshape unpack failed ({_RESHAPE_FAILED[0][:300]}); "
            "using one load a value from now on",
            RuntimeWarning,
            stacklevel=2,
        )
        run("gather")
    reduce_splits(out, y)
    return y.reshape(*lead, n)


def split_k_output(
    launch: GemmLaunch, split_k: int | None, k: int, y: torch.Tensor
) -> tuple[int, int, torch.Tensor]:
    """(splits of K, k tiles a split, where the kernel writes): split_k (or the launch's)
    clamped to K's tiles with no empty split; one split writes y itself, several write float32
    partial sums [split, M, N] for reduce_splits."""
    k_tiles = triton.cdiv(k, launch.block_k)
    split = max(1, min(launch.split_k if split_k is None else split_k, k_tiles))
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)  # no empty splits
    if split == 1:
        return split, tiles_per_split, y
    return (
        split,
        tiles_per_split,
        torch.empty(split, *y.shape, dtype=torch.float32, device=y.device),
    )


def reduce_splits(out: torch.Tensor, y: torch.Tensor) -> None:
    """The split-K partial sums into y (nothing where the kernel wrote y itself)."""
    if out is y:
        return
    torch.sum(out, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(out.sum(0))


def gemm_rows(x: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """The GEMM wrappers' prologue: x [..., K] as rows [M, K] with a unit inner stride, the
    output [M, N] in x's dtype, and x's leading shape (the output is reshaped to it)."""
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device), x.shape[:-1]


def quant_gemm(x: torch.Tensor, weight: QuantGemmWeight, **kwargs) -> torch.Tensor:
    """w_int_gemm on a repacked weight."""
    return w_int_gemm(
        x, weight.qweight, weight.scales, weight.zeros, weight.g_idx, weight.bits,
        weight.group_size, perm=weight.perm, **kwargs,
    )  # fmt: skip
