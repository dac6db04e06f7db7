"""Multi-LoRA shrink and expand over tokens grouped by adapter (punica / S-LoRA style).

A step's rows are grouped by adapter slot on the host (engine.lora.layers.LoRABatch): the
rows sorted by slot (token_rows) and, per segment (one adapter), its start in that list, its
length and its slot. One shrink per layer and one expand per slice of its output (q, k, v of
a merged qkv; gate, up), whatever the mix of adapters:

    shrink  s[p, :w]  = x[token_rows[p]] @ A[slot, :w]^T                 s: [rows, W]
    expand  y[token_rows[p], slice i] += s[p, off_i : off_i + r_i] @ B[slot, slice i, :r_i]^T

A [max_loras, W, in] holds each slot's slices' A packed on the rank (w: its total, off_i and
r_i: slice i's offset and rank, 0 where the adapter does not target it); B [max_loras, out,
R] each slice's B in its rows. A rank-8 adapter in a rank-64 slot reads rank 8. Each program
takes one segment's tile of BLOCK_M rows and BLOCK_N outputs; a row is in one segment only,
so expand's read-add-write needs no atomics. Rows of the base model are in no segment.

s is float32; expand rounds it to the weights' dtype before its dot, as the torch reference
(x @ A^T in the model's dtype) does. Under TRITON_INTERPRET=1 (tests without a GPU) the
operands are upcast to float32 before each dot (the interpreter's bf16 arithmetic is broken,
see the package docstring); float32 operands always take the full-precision dot (no tf32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    s_ptr,
    width_ptr,
    rows_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    K,
    stride_xm,
    stride_as,
    stride_an,
    stride_sm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    width = tl.load(width_ptr + slot)
    if pid_m * BLOCK_M >= length or pid_n * BLOCK_N >= width:
        return
    start = tl.load(seg_start_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < width
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + kk[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a = tl.load(
            a_base + offs_n[None, :] * stride_an + kk[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    pos = (start + offs_m).to(tl.int64)
    tl.store(
        s_ptr + pos[:, None] * stride_sm + offs_n[None, :],
        acc,
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _expand_kernel(
    s_ptr,
    b_ptr,
    y_ptr,
    off_ptr,
    rank_ptr,
    slice_idx,
    num_slices,
    rows_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    N,
    stride_sm,
    stride_bs,
    stride_bn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    width = tl.load(rank_ptr + slot * num_slices + slice_idx)  # this slice's rank
    if pid_m * BLOCK_M >= length or width == 0:
        return
    col = tl.load(off_ptr + slot * num_slices + slice_idx)  # its columns of s
    start = tl.load(seg_start_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    pos = (start + offs_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    for k0 in range(0, width, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < width
        s = tl.load(
            s_ptr + pos[:, None] * stride_sm + col + kk[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + offs_n[None, :] * stride_bn + kk[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        s = s.to(b_ptr.dtype.element_ty)  # the reference's x @ A^T in the model's dtype
        if UPCAST:
            s = s.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc += tl.dot(s, b, input_precision="ieee")
        else:
            acc += tl.dot(s, b)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _block_n(n: int) -> int:
    return max(16, min(64, triton.next_power_of_2(n)))


def lora_shrink_expand(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    width: torch.Tensor,
    slice_off: torch.Tensor,
    slice_rank: torch.Tensor,
    slices: list[tuple[int, int]],
    token_rows: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    max_rows: int,
) -> None:
    """y[rows of segment g] += the LoRA delta of slot_g (see the module's docstring), in
    place. x [T, K] and y [T, N] with unit last strides; a [S, W, K], b [S, N, R], width
    [S], slice_off and slice_rank [S, len(slices)] contiguous; slices: (first row, rows)."""
    num_rows, num_segs = token_rows.numel(), seg_slot.numel()
    if num_rows == 0:
        return
    K, W = x.shape[1], a.shape[1]
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    fp32 = a.dtype == torch.float32
    upcast = _INTERPRET and not fp32
    s = torch.empty(num_rows, W, dtype=torch.float32, device=x.device)
    block_m = 16
    grid_m = triton.cdiv(max_rows, block_m)
    bn = _block_n(W)
    _shrink_kernel[(num_segs, grid_m, triton.cdiv(W, bn))](
        x, a, s, width, token_rows, seg_start, seg_len, seg_slot,
        K, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=64, UPCAST=upcast, IEEE=fp32,
    )  # fmt: skip
    for i, (row, size) in enumerate(slices):
        bn = _block_n(size)
        _expand_kernel[(num_segs, grid_m, triton.cdiv(size, bn))](
            s, b[:, row:], y[:, row:], slice_off, slice_rank, i, len(slices),
            token_rows, seg_start, seg_len, seg_slot,
            size, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=16, UPCAST=upcast, IEEE=fp32,
        )  # fmt: skip
