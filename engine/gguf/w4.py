"""Q4_0 and Q4_1 GGUF blocks repacked, bit for bit, into cpu_w4's tiles of 16 rows.

A Q4_1 block is w = d * q + m per 32 weights (float16 d and m, codes 0..15): the form of
cpu_w4's groups, so its codes, scale and minimum move as they are. Q4_0's w = d * (q - 8) is
the same with m = -8d, exact in float16 (a power of two) unless it overflows, which is
refused. Nothing is requantized: the tiles stand for exactly the file's values, and the w4
kernel (1.3-2x the per-row GGUF dot kernel at decode batch sizes) reads them. Vectorized
torch over whole layers: SmolLM2-135M's 120 layers take well under a second.
"""

from __future__ import annotations

import torch

from engine.kernels.cpu import w4 as cpu_w4

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # ggml's block_q4_0 / block_q4_1: 32 weights each
TYPES = tuple(BLOCK_BYTES)


def supports(type_name: str, in_features: int) -> str | None:
    """None where blocks of this type and K repack into tiles the w4 kernel takes, else why
    not (the caller keeps them on the GGUF dot kernel)."""
    if type_name not in BLOCK_BYTES:
        return f"{type_name} is not a 4-bit block of w4's form"
    if in_features % cpu_w4.K_MULTIPLE:
        return f"K {in_features} is not a multiple of {cpu_w4.K_MULTIPLE}"
    return None


def repack(blocks: torch.Tensor, type_name: str, in_features: int) -> cpu_w4.Q4Weight:
    """uint8 [N, row bytes] Q4_0/Q4_1 rows (engine.gguf.blocks.read_linear_blocks) -> cpu_w4.Q4Weight
    with the file's codes, its float16 d as the scale and m (Q4_1) or -8d (Q4_0) as the
    minimum. Raises ValueError where the blocks cannot move losslessly."""
    why = supports(type_name, in_features)
    if why is not None:
        raise ValueError(why)
    n, groups, bpb = blocks.shape[0], in_features // cpu_w4.GROUP, BLOCK_BYTES[type_name]
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, groups * bpb):
        raise ValueError(f"{type_name} rows of K={in_features} are {groups * bpb} bytes")
    b = blocks.view(n, groups, bpb)

    def half(lo: int) -> torch.Tensor:  # bytes [lo, lo + 2) of each block as float16 [N, G]
        return b[..., lo : lo + 2].contiguous().view(torch.float16).view(n, groups)

    scales = half(0)
    if type_name == "Q4_1":
        mins, qs = half(2), b[..., 4:]
    else:
        mins, qs = (scales.float() * -8).half(), b[..., 2:]
        if not torch.isfinite(mins).all():
            raise ValueError("a Q4_0 scale's -8d overflows float16")
    # a block's 16 bytes: weight j in byte j's low nibble, weight 16 + j in its high one
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # [N, G, 32]
    return cpu_w4.pack_groups(codes, scales, mins)
