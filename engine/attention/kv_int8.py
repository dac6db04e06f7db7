"""The int8 KV cache (`--kv-cache-dtype int8`): half the bytes of a bf16 cache per token.

Decode attention at large batches is bound by reading K and V (on two CPU cores, a third to
a half of a batch-128 step), so storing them in int8 halves that traffic and doubles the
tokens a given cache memory holds. Each token's K (and V) row of each KV head is quantized on
its own, symmetrically: int8 values and one float32 scale, max|x| / 127.

Layout per layer: the cache is an int8 tensor shaped [2, blocks, block_size, kv_heads,
head_dim] like a float cache, but inside each block every KV head's tokens are tiled for
the kernel's integer dot products (engine.attention.cpu_kernel), which then need no
horizontal sums and no shuffles:
  K block: [kv_heads][head_dim / 2][block_size][2]  (a dimension pair of 16 tokens in 32 bytes)
  V block: [kv_heads][block_size / 2][head_dim][2]  (a token pair of 16 dimensions in 32 bytes)
Scales are float32 [2, blocks, kv_heads, block_size] (a head's scales for a block side by
side). Whole blocks move as before (copies for forks, TP shards are per head). This module
is the torch reference: quantize, write, and dequantize gathered blocks for the SDPA path;
Int8KVCacheSpec is the layout's bytes and allocation (engine.attention.kv_spec).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import cpu_kernel
from engine.attention.kv_spec import KVCacheSpec

QMAX = 127.0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], float32 scales [...]): x ~ scales[..., None] * q."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # A true division (python's QMAX / tensor would be reciprocal-then-multiply in torch):
    # the C writer computes the same IEEE quotient, so both store the same bytes.
    inv = torch.where(amax > 0, torch.full_like(amax, QMAX) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, (amax / QMAX).squeeze(-1)


def _k_tiles(half: torch.Tensor) -> torch.Tensor:
    """K half of a cache [blocks, bs, Hkv, D] -> its tiled view [blocks, Hkv, D/2, bs, 2]."""
    n, bs, h, d = half.shape
    return half.view(n, h, d // 2, bs, 2)


def _v_tiles(half: torch.Tensor) -> torch.Tensor:
    """V half of a cache [blocks, bs, Hkv, D] -> its tiled view [blocks, Hkv, bs/2, D, 2]."""
    n, bs, h, d = half.shape
    return half.view(n, h, bs // 2, d, 2)


def tile(natural: torch.Tensor) -> torch.Tensor:
    """int8 K/V in token order [2, blocks, bs, Hkv, D] -> the same values in the cache layout."""
    out = torch.empty_like(natural)
    _, n, bs, h, d = natural.shape
    _k_tiles(out[0]).copy_(natural[0].view(n, bs, h, d // 2, 2).permute(0, 2, 3, 1, 4))
    _v_tiles(out[1]).copy_(natural[1].view(n, bs // 2, 2, h, d).permute(0, 3, 1, 4, 2))
    return out


def quantize_cache(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float K/V [2, blocks, bs, Hkv, D] -> (the int8 cache, its scales [2, blocks, Hkv, bs])."""
    q, s = quantize(x)
    return tile(q), s.transpose(2, 3).contiguous()


def allocate_scales(num_blocks: int, block_size: int, num_kv_heads: int, device) -> torch.Tensor:
    return torch.zeros((2, num_blocks, num_kv_heads, block_size), device=device)


@dataclass(slots=True, frozen=True)
class Int8KVCacheSpec(KVCacheSpec):
    """`int8`: int8 values in the tiled block layout above, and a float32 scale per token and
    KV head beside each of K and V (allocate_scales)."""

    @property
    def cache_dtype(self) -> torch.dtype:
        return torch.int8

    @property
    def scale_bytes_per_token(self) -> int:
        return 4 * self.num_kv_heads

    def allocate_scales(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return allocate_scales(num_blocks, self.block_size, self.num_kv_heads, device)

    @staticmethod
    def write_reference(cache, scales, slot_mapping, k, v) -> None:
        write(cache, scales, slot_mapping, k, v, use_kernel=False)  # the torch quantizer

    @staticmethod
    def gather_reference(cache, scales, block_table, out) -> torch.Tensor:
        return gather_dequantized(cache, scales, block_table, out)


def write(
    cache: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    use_kernel: bool | None = None,
) -> None:
    """Store k/v [T, Hkv, D] at their flat slots, quantized. use_kernel: None = the C writer
    where the kernel runs (it stores the same bytes); False = torch (the tests' reference)."""
    _, hkv, d = k.shape
    if use_kernel is None:
        rows = all(x.stride(2) == 1 and x.stride(1) == d for x in (k, v))  # heads contiguous
        use_kernel = rows and cpu_kernel.kernel_supports(k.dtype, k.device, hkv, d)
    if use_kernel:
        cpu_kernel.write_kv_int8(cache[0], cache[1], scales[0], scales[1], slot_mapping, k, v)
        return
    bs = cache.shape[2]
    block, offset = slot_mapping // bs, slot_mapping % bs
    (kq, ks), (vq, vs) = quantize(k), quantize(v)
    _k_tiles(cache[0])[block, :, :, offset] = kq.view(-1, hkv, d // 2, 2)
    _v_tiles(cache[1])[block, :, offset // 2, :, offset % 2] = vq
    scales[0][block, :, offset] = ks
    scales[1][block, :, offset] = vs


def gather_dequantized(
    cache: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """K and V of the given blocks, in order, dequantized into out [2, n, bs, Hkv, D] (token
    order)."""
    _, n, bs, h, d = out.shape
    k = _k_tiles(cache[0].index_select(0, block_table)).permute(0, 3, 1, 2, 4)
    v = _v_tiles(cache[1].index_select(0, block_table)).permute(0, 2, 4, 1, 3)
    ks = scales[0].index_select(0, block_table).transpose(1, 2)  # [n, bs, Hkv]
    vs = scales[1].index_select(0, block_table).transpose(1, 2)
    torch.mul(k, ks[..., None, None], out=out[0].view(n, bs, h, d // 2, 2))
    torch.mul(v, vs.reshape(n, bs // 2, 2, h, 1), out=out[1].view(n, bs // 2, 2, h, d))
    return out
