"""Fused mixture-of-experts on CUDA: every (token, k) pair routed to its expert, two grouped
GEMMs for all experts at once.

moe_align_block_size sorts the T * top_k pairs by expert and pads each expert's run to a
multiple of BLOCK_M, so each block of BLOCK_M rows belongs to one expert (expert_ids[block]).
Then one launch of _fused_moe_kernel per projection, a grid of (blocks, N tiles):

  1. gate_up: rows of x gathered by pair (pair // top_k), times w13[e]^T, with SiLU-and-mul
     in the epilogue (the gate and up tiles of the same columns are two accumulators):
     intermediate [T * top_k, I] in x's dtype;
  2. down: intermediate rows times w2[e]^T, each row scaled by its routing weight in the
     epilogue: [T * top_k, H] in float32;

and the top-k rows of each token are summed (one torch reduction) and cast to x's dtype.
gpt-oss's experts add a bias to each product (before the activation, before the routing
weight) and take the clamped SwiGLU (ACT_SWIGLU_OAI) instead of SiLU-and-mul.

No host sync, so it captures into a CUDA graph: the alignment is torch ops on the device
(scatter_add counts, a stable sort, cumsums, searchsorted) into buffers sized by the static
bound T * top_k + min(E, T * top_k) * (BLOCK_M - 1); the grid is that bound's block count, and
blocks past the device-side padded total (num_tokens_post_padded) return at once. Block sizes
depend only on the shapes.

fused_experts_quantized is the same for a quantized checkpoint's experts (ExpertWeights; engine.
layers.quantization.experts): FP8 weights widened in the inner loop with their row scales in
the epilogue (block-FP8: each weight times its block's scale in the loop), or 4/8-bit codes
dequantized per tile with their group scales and zero points (act-order: the rows sorted by
group at load, a's columns gathered through each expert's permutation), or MXFP4's e2m1 codes
with an E8M0 power of two per 32 inputs (gpt-oss), decoded into floats in the inner loop.
gpt-oss's biases and clamped SwiGLU run in the quantized kernel's epilogues as in the float one.

Under TRITON_INTERPRET=1 (the tests without a GPU) the operands are upcast to float32 before
each dot: the interpreter's bf16 arithmetic is broken (see the package docstring).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _epilogue(
    acc, acc_up, c_ptr, weights_ptr, bias_ptr, expert, pairs, row_ok, offs_n, n_ok, N,
    stride_cm, stride_cn, stride_bias_e, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT_SWIGLU_OAI: tl.constexpr, SWIGLU_ALPHA: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr,
):  # fmt: skip
    """Both kernels' tile epilogue: the expert's biases, the gated activation (SiLU-and-mul,
    or gpt-oss's clamped SwiGLU), the pair's routing weight, the store."""
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_row + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        if ACT_SWIGLU_OAI:
            gate = tl.minimum(acc, SWIGLU_LIMIT)
            up = tl.minimum(tl.maximum(acc_up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
            acc = (up + 1.0) * gate / (1.0 + tl.exp(-SWIGLU_ALPHA * gate))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    bias_ptr,  # [E, N] (gate_up: [E, 2N], gate | up), read with HAS_BIAS
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_bias_e,
    A_DIV: tl.constexpr,  # a's row of pair p is p // A_DIV (top_k for x, 1 for the intermediate)
    SILU_MUL: tl.constexpr,  # b has 2N rows (gate | up): c = silu(a b_gate^T) * (a b_up^T)
    MUL_WEIGHT: tl.constexpr,  # c's row p scaled by weights[p]
    HAS_BIAS: tl.constexpr,
    ACT_SWIGLU_OAI: tl.constexpr,  # with SILU_MUL: gpt-oss's clamped SwiGLU instead
    SWIGLU_ALPHA: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,  # float32 operands: full-precision dot (no tf32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)  # padding rows hold num_valid
    row_ok = pairs < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pairs // A_DIV).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (
        b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
        + offs_k[:, None] * stride_bk
    )  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if SILU_MUL:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            if IEEE:
                acc_up += tl.dot(a, b_up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, b_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    _epilogue(
        acc, acc_up, c_ptr, weights_ptr, bias_ptr, expert, pairs, row_ok, offs_n, n_ok, N,
        stride_cm, stride_cn, stride_bias_e, SILU_MUL, MUL_WEIGHT, HAS_BIAS, ACT_SWIGLU_OAI,
        SWIGLU_ALPHA, SWIGLU_LIMIT,
    )  # fmt: skip


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the average pairs an expert gets (shapes only, never the routing)."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, top_k] -> (sorted_ids, expert_ids, num_tokens_post_padded).

    sorted_ids [P]: the flat pair indices (t * top_k + k) grouped by expert in ascending order,
    each expert's run padded with num_pairs to a multiple of block_m, P a static upper bound;
    expert_ids [P / block_m]: each block's expert; num_tokens_post_padded [1]: the padded
    total (the blocks past it are not used). Device-side torch ops only: no host sync."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    bound = n + min(num_experts, n) * (block_m - 1)
    padded_len = triton.cdiv(bound, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first position among the sorted pairs
    rank = torch.arange(n, device=device) - first[sorted_experts]
    dest = starts[sorted_experts] + rank
    sorted_ids = torch.full((padded_len,), n, dtype=torch.int64, device=device)
    sorted_ids.scatter_(0, dest, order)
    block_starts = torch.arange(0, padded_len, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids, ends[-1:]


def _launch(
    a, b, c, weights, sorted_ids, expert_ids, num_post, n, a_div, silu, mul_weight, bm,
    bias=None, swiglu=None,
):  # fmt: skip
    k = a.shape[1]
    block_n = 64 if n >= 64 else 32
    block_k = 64 if k >= 64 else 32
    fp32 = a.dtype == torch.float32
    grid = (sorted_ids.numel() // bm, triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](
        a, b, c, weights, c if bias is None else bias, sorted_ids, expert_ids, num_post,
        n, k, weights.numel(),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        0 if bias is None else bias.stride(0),
        A_DIV=a_div, SILU_MUL=silu, MUL_WEIGHT=mul_weight,
        HAS_BIAS=bias is not None, ACT_SWIGLU_OAI=swiglu is not None,
        SWIGLU_ALPHA=0.0 if swiglu is None else float(swiglu[0]),
        SWIGLU_LIMIT=0.0 if swiglu is None else float(swiglu[1]),
        UPCAST=_INTERPRET and not fp32, IEEE=fp32,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation: str = "silu",
    swiglu: tuple[float, float] = (1.702, 7.0),
    lora: tuple[Callable, Callable, Callable] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate | up), w2 [E, H, I], topk_weights / topk_ids [T, top_k]
    -> sum_k topk_weights[t, k] * w2[e] (silu(w13[e, :I] x) * w13[e, I:] x), e = topk_ids[t, k];
    [T, H] in x's dtype. biases: (b13 [E, 2I], b2 [E, H]) added to the two products;
    activation "swigluoai": gpt-oss's clamped SwiGLU (engine.layers.activation) with swiglu's
    (alpha, limit).

    lora: (add13, act, add2), a step's LoRA adapters on the experts (engine.lora.experts):
    the first GEMM then stores the gate_up products [T * top_k, 2I] (no activation in its
    epilogue), add13(pre) adds their deltas in place, act(pre) is the activation, and after
    the second GEMM add2(h, out, weights) adds each pair's weighted down delta to out."""
    t, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    if t == 0:
        return torch.empty_like(x)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    bm = block_m_for(n, num_experts)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, bm, num_experts)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    b13, b2 = (None, None) if biases is None else biases
    oai = swiglu if activation == "swigluoai" else None

    def gate_up(c: torch.Tensor, silu: bool) -> None:
        _launch(x, w13, c, weights, sorted_ids, expert_ids, num_post, c.shape[1], top_k, silu,
                False, bm, b13, oai if silu else None)  # fmt: skip

    def down(a: torch.Tensor, out: torch.Tensor) -> None:
        _launch(a, w2, out, weights, sorted_ids, expert_ids, num_post, hidden, 1, False, True, bm,
                b2)  # fmt: skip

    return _two_gemms(x, top_k, inter, hidden, weights, gate_up, down, lora)


def _two_gemms(x, top_k, inter, hidden, weights, gate_up, down, lora) -> torch.Tensor:
    """The experts' output from the two grouped GEMMs: gate_up(c, silu) writes [pairs, I]
    activated (silu) or [pairs, 2I] as products; down(a, out) writes the weighted [pairs, H];
    lora: fused_experts' (add13, act, add2) between them."""
    n = x.shape[0] * top_k
    if lora is None:
        act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
        gate_up(act, True)
    else:
        add13, activate, add2 = lora
        pre = torch.empty(n, 2 * inter, dtype=x.dtype, device=x.device)
        gate_up(pre, False)
        add13(pre)
        act = activate(pre).contiguous()
    out = torch.empty(n, hidden, dtype=torch.float32, device=x.device)
    down(act, out)
    if lora is not None:
        add2(act, out, weights)
    return out.view(x.shape[0], top_k, hidden).sum(dim=1).to(x.dtype)


# -- quantized experts: the same two grouped GEMMs, the weights widened in the inner loop -----


@dataclass(slots=True)
class ExpertWeights:
    """One projection's quantized experts for fused_experts_quantized.

    bits 0: float8_e4m3fn `data` [E, N, K] with float32 row `scales` [E, N], applied in the
    epilogue; with a `group` (block-FP8: the inputs a block scale covers) float32 `scales`
    [E, N, ceil(K / group)], one row of block scales per output row, applied per weight in
    the inner loop. bits 4 or 8: unsigned codes, uint8 [E, N, K * bits / 8] (4-bit: k even in the low
    nibble), float32 `scales` [E, N, K / group] and int32 `zeros` like them (None: symmetric,
    2 ** (bits - 1)); w = (q - zero) * scale, dequantized per tile in the inner loop.
    Act-order (engine.layers.quantization.experts.sort_rows_by_group): each expert's rows
    sorted by group, `perm` int32 [E, K] the input column each sorted row multiplies (the
    kernel gathers a's columns through it), and `g_idx` int32 [E, K] each sorted row's group
    where that is not k // group (a tensor-parallel shard of down: its groups index the full
    scales).

    mxfp4 (bits 4, group 32): OpenAI's MXFP4 as its checkpoints store it, which the kernel reads
    as is: uint8 `data` [E, N, K / 2] (two e2m1 codes a byte, k even in the low nibble: sign,
    then 0, 0.5, 1, 1.5, 2, 3, 4, 6) and uint8 `scales` [E, N, G] (E8M0: 2 ** (byte - 127)),
    w = value * scale; `group_offset`: input row k's group is (k + group_offset) // 32 (a
    tensor-parallel shard of down that starts inside a group of 32)."""

    data: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    bits: int = 0
    group: int = 0
    perm: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    mxfp4: bool = False
    group_offset: int = 0

    @property
    def n(self) -> int:
        return self.data.shape[1]


@triton.jit
def _load_quant_b(
    b_ptr, s_ptr, z_ptr, expert, offs_n, kk, grp, mask, stride_be, stride_bn, stride_se,
    stride_sn, BITS: tl.constexpr, HAS_ZP: tl.constexpr, FP8_GROUPS: tl.constexpr,
    MXFP4: tl.constexpr,
):  # fmt: skip
    """The float32 [BLOCK_K, BLOCK_N] tile of expert's weight^T at input rows kk (of groups
    grp), columns offs_n."""
    base = expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    if MXFP4:  # e2m1 code and E8M0 scale, each built as float32 bits (exact, no lookup)
        byte = tl.load(b_ptr + base + (kk // 2)[:, None], mask=mask, other=0)
        q = (byte.to(tl.int32) >> ((kk % 2) * 4)[:, None]) & 15
        mag = q & 7  # exponent field mag >> 1 (bias 1), mantissa bit mag & 1
        bits = tl.where(mag >= 2, (((mag >> 1) + 126) << 23) | ((mag & 1) << 22),
                        tl.where(mag == 1, 126 << 23, 0))  # fmt: skip
        v = (bits | ((q & 8) << 28)).to(tl.float32, bitcast=True)
        s_off = expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn + grp[:, None]
        e = tl.load(s_ptr + s_off, mask=mask, other=127).to(tl.int32)
        # 2 ** (e - 127): the exponent field e, or (e == 0) the subnormal 2 ** -127
        scale = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
        w = v * scale
    elif BITS == 0:  # float8 values, scaled here per block of K, or in the epilogue per row
        w = tl.load(b_ptr + base + kk[:, None], mask=mask, other=0.0).to(tl.float32)
        if FP8_GROUPS:
            s_off = expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn + grp[:, None]
            w = w * tl.load(s_ptr + s_off, mask=mask, other=0.0)
    else:
        if BITS == 4:
            byte = tl.load(b_ptr + base + (kk // 2)[:, None], mask=mask, other=0)
            q = (byte.to(tl.int32) >> ((kk % 2) * 4)[:, None]) & 15
        else:
            q = tl.load(b_ptr + base + kk[:, None], mask=mask, other=0).to(tl.int32)
        s_off = expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn + grp[:, None]
        s = tl.load(s_ptr + s_off, mask=mask, other=0.0)
        if HAS_ZP:
            z = tl.load(z_ptr + s_off, mask=mask, other=0)
        else:
            z = 1 << (BITS - 1)
        w = (q - z).to(tl.float32) * s
    return w


@triton.jit
def _fused_moe_quant_kernel(
    a_ptr, b_ptr, s_ptr, z_ptr, perm_ptr, g_ptr, c_ptr, weights_ptr, bias_ptr, sorted_ids_ptr,
    expert_ids_ptr, num_post_padded_ptr, N, K, num_valid, group_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_se, stride_sn, stride_cm, stride_cn,
    stride_bias_e,
    A_DIV: tl.constexpr, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, FP8_GROUPS: tl.constexpr,
    MXFP4: tl.constexpr, HAS_PERM: tl.constexpr, HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT_SWIGLU_OAI: tl.constexpr, SWIGLU_ALPHA: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """_fused_moe_kernel with b an ExpertWeights: its tiles dequantized to a's dtype (float32
    under the interpreter) before each dot; FP8's row scales multiply the accumulators.
    HAS_PERM: a's columns read through the expert's perm [E, K] (act-order's sorted rows);
    HAS_G_IDX: each row's group read from g_idx [E, K], else (k + group_offset) // GROUP.
    HAS_BIAS / ACT_SWIGLU_OAI: gpt-oss's biases and clamped SwiGLU, as _fused_moe_kernel's."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pairs < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (pairs // A_DIV).to(tl.int64)
    a_row_ptrs = a_ptr + a_rows[:, None] * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        kk = k0 * BLOCK_K + offs_k
        k_ok = kk < K
        if HAS_PERM:  # sorted row kk multiplies a's column perm[expert, kk]
            cols = tl.load(perm_ptr + expert * K + kk, mask=k_ok, other=0)
        else:
            cols = kk
        a = tl.load(a_row_ptrs + cols[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        if HAS_G_IDX:
            grp = tl.load(g_ptr + expert * K + kk, mask=k_ok, other=0)
        else:
            grp = (kk + group_offset) // GROUP
        mask = k_ok[:, None] & n_ok[None, :]
        b = _load_quant_b(b_ptr, s_ptr, z_ptr, expert, offs_n, kk, grp, mask, stride_be,
                          stride_bn, stride_se, stride_sn, BITS, HAS_ZP, FP8_GROUPS,
                          MXFP4)  # fmt: skip
        if UPCAST:
            a = a.to(tl.float32)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b.to(a.dtype))
        if SILU_MUL:
            b_up = _load_quant_b(b_ptr, s_ptr, z_ptr, expert, offs_n + N, kk, grp, mask,
                                 stride_be, stride_bn, stride_se, stride_sn, BITS, HAS_ZP,
                                 FP8_GROUPS, MXFP4)  # fmt: skip
            if UPCAST:
                acc_up += tl.dot(a, b_up, input_precision="ieee")
            else:
                acc_up += tl.dot(a, b_up.to(a.dtype))
    if BITS == 0 and not FP8_GROUPS:
        s_row = s_ptr + expert * stride_se + offs_n * stride_sn
        acc = acc * tl.load(s_row, mask=n_ok, other=0.0)[None, :]
        if SILU_MUL:
            acc_up = acc_up * tl.load(s_row + N * stride_sn, mask=n_ok, other=0.0)[None, :]
    _epilogue(
        acc, acc_up, c_ptr, weights_ptr, bias_ptr, expert, pairs, row_ok, offs_n, n_ok, N,
        stride_cm, stride_cn, stride_bias_e, SILU_MUL, MUL_WEIGHT, HAS_BIAS, ACT_SWIGLU_OAI,
        SWIGLU_ALPHA, SWIGLU_LIMIT,
    )  # fmt: skip


def _launch_quant(a, b: ExpertWeights, c, weights, sorted_ids, expert_ids, num_post, n, k,
                  a_div, silu, mul_weight, bm, bias=None, swiglu=None):  # fmt: skip
    block_n = 64 if n >= 64 else 32
    block_k = 64 if k >= 64 else 32
    grid = (sorted_ids.numel() // bm, triton.cdiv(n, block_n))
    zeros = b.zeros if b.zeros is not None else b.scales  # unread without HAS_ZP
    perm = b.perm if b.perm is not None else b.scales  # unread without HAS_PERM
    g_idx = b.g_idx if b.g_idx is not None else b.scales  # unread without HAS_G_IDX
    if b.perm is not None or b.g_idx is not None:
        assert b.bits and (b.perm is None or b.perm.shape == (b.data.shape[0], k))
    _fused_moe_quant_kernel[grid](
        a, b.data, b.scales, zeros, perm, g_idx, c, weights, c if bias is None else bias,
        sorted_ids, expert_ids, num_post, n, k, weights.numel(), b.group_offset,
        a.stride(0), a.stride(1), b.data.stride(0), b.data.stride(1),
        b.scales.stride(0), b.scales.stride(1), c.stride(0), c.stride(1),
        0 if bias is None else bias.stride(0),
        A_DIV=a_div, SILU_MUL=silu, MUL_WEIGHT=mul_weight,
        BITS=b.bits, GROUP=max(b.group, 1), HAS_ZP=b.zeros is not None,
        FP8_GROUPS=b.bits == 0 and b.group > 0, MXFP4=b.mxfp4,
        HAS_PERM=b.perm is not None, HAS_G_IDX=b.g_idx is not None,
        HAS_BIAS=bias is not None, ACT_SWIGLU_OAI=swiglu is not None,
        SWIGLU_ALPHA=0.0 if swiglu is None else float(swiglu[0]),
        SWIGLU_LIMIT=0.0 if swiglu is None else float(swiglu[1]),
        UPCAST=_INTERPRET or a.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip


def fused_experts_quantized(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation: str = "silu",
    swiglu: tuple[float, float] = (1.702, 7.0),
    lora: tuple[Callable, Callable, Callable] | None = None,
) -> torch.Tensor:
    """fused_experts on quantized experts (ExpertWeights: w13 of 2I rows, gate | up; w2 of H
    rows over I inputs); [T, H] in x's dtype. biases, activation, swiglu and lora as
    fused_experts'."""
    t, hidden = x.shape
    num_experts, two_i = w13.data.shape[0], w13.n
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    if t == 0:
        return torch.empty_like(x)
    assert x.stride(1) == 1 and w13.data.stride(2) == 1 and w2.data.stride(2) == 1
    bm = block_m_for(n, num_experts)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, bm, num_experts)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    b13, b2 = (None, None) if biases is None else biases
    oai = swiglu if activation == "swigluoai" else None

    def gate_up(c: torch.Tensor, silu: bool) -> None:
        _launch_quant(x, w13, c, weights, sorted_ids, expert_ids, num_post, c.shape[1], hidden,
                      top_k, silu, False, bm, b13, oai if silu else None)  # fmt: skip

    def down(a: torch.Tensor, out: torch.Tensor) -> None:
        _launch_quant(a, w2, out, weights, sorted_ids, expert_ids, num_post, hidden, inter, 1,
                      False, True, bm, b2)  # fmt: skip

    return _two_gemms(x, top_k, inter, hidden, weights, gate_up, down, lora)
