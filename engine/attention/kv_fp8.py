"""The fp8 KV cache (`--kv-cache-dtype fp8`): float8 e4m3 values, one byte per value, so twice
the tokens of a bf16 cache fit in the same memory and decode reads half the bytes.

Scales: one per tensor, a scale for K and one for V per layer (PagedAttention.k_scale /
v_scale): the checkpoint's calibrated ones where it carries them (FP8-KV uploads,
engine.layers.quantization.kv_scales), else 1.0, as vLLM does: K and V of the supported
models sit well inside e4m3's range (+-448), and e4m3 keeps 3 mantissa bits at every
magnitude there. Values beyond the range saturate to +-448 (no NaN). The Triton kernels take
the scales as arguments.

The cache keeps the float layout [2, blocks, block_size, kv_heads, head_dim]. This module is
the torch reference: quantize, write through the slot mapping, dequantize gathered blocks;
Fp8KVCacheSpec is its bytes and allocation (engine.attention.kv_spec). Index ops run on
uint8 views (float8 index kernels are not on every device): the cache is allocated as bytes
(block copies need no float8 index kernels) and the layers see it as float8 e4m3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.kv_spec import KVCacheSpec

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
K_SCALE = 1.0
V_SCALE = 1.0


@dataclass(slots=True, frozen=True)
class Fp8KVCacheSpec(KVCacheSpec):
    """`fp8`: one byte a value, held as uint8 and seen by the layers as e4m3; the scales are
    per tensor (K_SCALE, V_SCALE), so a block holds no scale."""

    @property
    def cache_dtype(self) -> torch.dtype:
        return FP8_DTYPE

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def view(self, storage: torch.Tensor) -> torch.Tensor:
        return storage.view(FP8_DTYPE)

    # scales: the layer's (k_scale, v_scale)
    @staticmethod
    def write_reference(cache, scales, slot_mapping, k, v) -> None:
        write(cache, slot_mapping, k, v, *scales)

    @staticmethod
    def gather_reference(cache, scales, block_table, out) -> torch.Tensor:
        return gather_dequantized(cache, block_table, out, *scales)


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 values of x / scale, saturated, rounded to nearest even."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def write(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = K_SCALE,
    v_scale: float = V_SCALE,
) -> None:
    """Store k/v [T, Hkv, D] at their flat slots of an fp8 cache [2, blocks, bs, Hkv, D]."""
    _, hkv, d = k.shape
    flat = cache.view(torch.uint8).view(2, -1, hkv, d)
    flat[0].index_copy_(0, slot_mapping, quantize(k, k_scale).view(torch.uint8))
    flat[1].index_copy_(0, slot_mapping, quantize(v, v_scale).view(torch.uint8))


def gather_dequantized(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    k_scale: float = K_SCALE,
    v_scale: float = V_SCALE,
) -> torch.Tensor:
    """The given blocks of an fp8 cache, in order, in out's dtype: out [2, n, bs, Hkv, D]."""
    raw = cache.view(torch.uint8)
    for i, scale in ((0, k_scale), (1, v_scale)):
        blocks = torch.index_select(raw[i], 0, block_table).view(FP8_DTYPE)
        out[i].copy_(dequantize(blocks, scale, out.dtype))
    return out
