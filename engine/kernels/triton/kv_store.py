"""This step's K/V into the paged cache through the slot mapping: one program per token.

Token t's K and V rows (all KV heads) go to flat slot slot_mapping[t] of a cache
[2, blocks, block_size, kv_heads, head_dim]; a negative slot (PAD_SLOT_ID: the padding rows of
a captured graph) writes nowhere. An fp8 cache stores x / scale saturated to +-448, rounded to
nearest even: the bytes engine.attention.kv_fp8.quantize stores. The kernel forms those bytes
with integer ops (stored through a uint8 view) rather than a float8 cast: the interpreter's
cast to float8 rounds half up and loses the carry into the exponent, and the integer form is
the same on a GPU, so the tests check the code a GPU runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # e4m3fn's largest finite value (a constexpr: jit reads it)


@triton.jit
def _e4m3_bits(x):
    """fp32 values within +-448 -> their float8 e4m3fn bytes (int32), rounded to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    a_bits = a.to(tl.int32, bitcast=True)
    exponent = (a_bits >> 23) - 127
    mantissa = a_bits & 0x7FFFFF
    # normal: 3 of fp32's 23 mantissa bits, rounded half to even; a carry moves the exponent
    kept = mantissa >> 20
    rest = mantissa & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((kept & 1) == 1))
    normal = ((exponent + 7) << 3) + kept + up.to(tl.int32)
    # below 2^-6: multiples of 2^-9; adding and removing 2^23 rounds to an integer, half to even
    scaled = a * 512.0
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    return sign | tl.where(exponent < -6, subnormal, normal)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    # (slot >= 0 as a tensor: the interpreter's & of a scalar bool and a tensor is no bool)
    padding = (heads[:, None] * 0 + slot) < 0
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & ~padding
    src_k = k_ptr + t.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    block = slot // BLOCK_SIZE
    dst = block * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_token
    dst = dst + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if FP8:  # the cache pointers are uint8 views
        # Upcast first: the interpreter cannot do arithmetic on bf16 values.
        k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
        k = _e4m3_bits(k).to(tl.uint8)
        v = _e4m3_bits(v).to(tl.uint8)
    else:
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k/v [T, Hkv, D] (rows may be strided; the last dim contiguous) into kv_cache
    [2, blocks, block_size, Hkv, D] at slot_mapping [T] (int64; < 0: nowhere). An fp8
    (float8_e4m3fn) cache stores the values divided by the scales; other caches store k/v
    cast to the cache dtype."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    assert (cache_heads, cache_dim) == (hkv, d), "k/v heads and dims must match the cache"
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    raw = kv_cache.view(torch.uint8) if fp8 else kv_cache
    k_cache, v_cache = raw[0], raw[1]
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        HEADS_PAD=triton.next_power_of_2(hkv),
        DIM_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=block_size,
        FP8=fp8,
    )  # fmt: skip
