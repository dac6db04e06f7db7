"""The int8 KV cache (`--kv-cache-dtype int8`): half the bytes of a bf16 cache per token.

Decode attention at large batches is bound by reading K and V (on two CPU cores, a third to
a half of a batch-128 step), so storing them in int8 halves that traffic and doubles the
tokens a given cache memory holds. Each token's K (and V) row of each KV head is quantized on
its own, symmetrically: int8 values and one float32 scale, max|x| / 127.

Layout per layer: the cache [2, blocks, block_size, kv_heads, head_dim] in int8, and scales
[2, blocks, kv_heads, block_size] in float32 (a head's scales for a block side by side, as
the kernel reads them 16 tokens at a time). The compiled CPU kernel reads this cache directly
(engine.attention.cpu_kernel); this module is the torch reference: quantize, write, and
dequantize gathered blocks for the torch/SDPA path.
"""

from __future__ import annotations

import torch

from engine.attention import cpu_kernel

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


def allocate_scales(num_blocks: int, block_size: int, num_kv_heads: int, device) -> torch.Tensor:
    return torch.zeros((2, num_blocks, num_kv_heads, block_size), device=device)


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
    flat = cache.view(2, -1, hkv, d)
    block, offset = slot_mapping // bs, slot_mapping % bs
    for i, x in enumerate((k, v)):
        q, s = quantize(x)
        flat[i].index_copy_(0, slot_mapping, q)
        scales[i][block, :, offset] = s


def gather_dequantized(
    cache: torch.Tensor, scales: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """K and V of the given blocks, in order, dequantized into out [2, n, bs, Hkv, D]."""
    for i in range(2):
        q = cache[i].index_select(0, block_table)  # [n, bs, Hkv, D]
        s = scales[i].index_select(0, block_table).transpose(1, 2)  # [n, bs, Hkv]
        torch.mul(q, s.unsqueeze(-1), out=out[i])
    return out
