"""The fp8 KV cache (`--kv-cache-dtype fp8`): float8 e4m3 values, one byte per value, so twice
the tokens of a bf16 cache fit in the same memory and decode reads half the bytes.

Scales: one per tensor (a scale for K and one for V, the same for every layer), fixed at 1.0,
as vLLM does when a checkpoint carries no KV scales: K and V of the supported models sit well
inside e4m3's range (+-448), and e4m3 keeps 3 mantissa bits at every magnitude there. Values
beyond the range saturate to +-448 (no NaN). The Triton kernels take the scales as arguments,
so calibrated scales would change no kernel.

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

    @staticmethod
    def write_reference(cache, scales, slot_mapping, k, v) -> None:
        write(cache, slot_mapping, k, v)

    @staticmethod
    def gather_reference(cache, scales, block_table, out) -> torch.Tensor:
        return gather_dequantized(cache, block_table, out)


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 values of x / scale, saturated, rounded to nearest even."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def write(
    cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store k/v [T, Hkv, D] at their flat slots of an fp8 cache [2, blocks, bs, Hkv, D]."""
    _, hkv, d = k.shape
    flat = cache.view(torch.uint8).view(2, -1, hkv, d)
    flat[0].index_copy_(0, slot_mapping, quantize(k, K_SCALE).view(torch.uint8))
    flat[1].index_copy_(0, slot_mapping, quantize(v, V_SCALE).view(torch.uint8))


def gather_dequantized(
    cache: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The given blocks of an fp8 cache, in order, in out's dtype: out [2, n, bs, Hkv, D]."""
    raw = cache.view(torch.uint8)
    for i, scale in ((0, K_SCALE), (1, V_SCALE)):
        blocks = torch.index_select(raw[i], 0, block_table).view(FP8_DTYPE)
        out[i].copy_(dequantize(blocks, scale, out.dtype))
    return out
