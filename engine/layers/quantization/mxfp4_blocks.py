"""MXFP4's bytes (OpenAI's gpt-oss experts): e2m1 codes, two a byte, and an E8M0 power of two
(bias 127) per 32 values; decoded into floats, or repacked into ggml's MXFP4 blocks (the same
bits), which the GGUF kernels run.

OpenAI's checkpoints order a byte's codes low nibble first (values 2j, 2j + 1); llama.cpp's
gpt-oss GGUF files hold the same values in ggml's block_mxfp4 (split_ggml_blocks: the scale
byte, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31: `halves`), which
the same helpers read. No import beyond torch: the MXFP4 checkpoint config and the GGUF linear
method both use them.
"""

from __future__ import annotations

import torch

# e2m1: the sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)


def _codes(blocks: torch.Tensor, lut: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """blocks uint8 [..., G, 16] -> lut's value of each e2m1 code [..., G, 32]: a byte's low
    nibble, then its high one (OpenAI's order), or (halves: ggml's) the 16 low nibbles, then
    the 16 high ones."""
    b = blocks.to(torch.uint8)
    low, high = lut[(b & 0x0F).long()], lut[(b >> 4).long()]
    if halves:
        return torch.cat((low, high), dim=-1)
    return torch.stack((low, high), dim=-1).flatten(-2)


GGML_BLOCK_BYTES = 17  # ggml's block_mxfp4: the E8M0 scale, then 16 bytes of codes


def split_ggml_blocks(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF MXFP4 tensor's rows, uint8 [..., G * 17] -> (codes [..., G, 16] in ggml's
    nibble order: halves=True for the helpers here, scales [..., G]), views of rows."""
    blocks = rows.reshape(*rows.shape[:-1], -1, GGML_BLOCK_BYTES)
    return blocks[..., 1:], blocks[..., 0]


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, halves: bool = False
) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype (halves:
    the codes in ggml's nibble order)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            "(blocks [..., G, 16], scales [..., G])"
        )
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device=blocks.device)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    # one leading index (an expert) at a time: the float32 intermediates stay one expert's
    # (gpt-oss-120b's gate_up: 128 x 5760 x 2880 values a layer)
    parts = zip(blocks, scales, out, strict=True) if blocks.dim() > 2 else [(blocks, scales, out)]
    for b, s, o in parts:
        exponents = s.to(torch.int32) - 127
        o.copy_(torch.ldexp(_codes(b, lut, halves), exponents.unsqueeze(-1)).flatten(-2))
    return out


def to_gguf_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G] -> GGUF MXFP4 rows, uint8
    [E, rows, G * 17], the same bits: each block's E8M0 byte, then its codes with value j in
    byte j's low nibble and value j + 16 in its high one (ggml's order; the checkpoint's
    byte j holds values 2j and 2j + 1)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            "(blocks [..., G, 16], scales [..., G])"
        )
    out = torch.empty(*blocks.shape[:-1], GGML_BLOCK_BYTES, dtype=torch.uint8)
    for e in range(blocks.shape[0]):  # one expert's intermediates at a time
        b = blocks[e].to(torch.uint8)
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [rows, G, 32], in order
        out[e, ..., 0] = scales[e]
        out[e, ..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.flatten(-2)


def blocks_width(blocks: torch.Tensor) -> int:
    """The values a row of MXFP4 blocks [..., G, 16] holds."""
    return blocks.shape[-2] * 32
