"""MXFP4 checkpoints (OpenAI's gpt-oss: quantization_config.quant_method "mxfp4").

Only the MoE experts are MXFP4 (the attention, router, embeddings and LM head stay bf16: the
config's modules_to_not_convert), each weight as a pair: `*_blocks` uint8 [..., G, 16] (two
FP4 e2m1 values a byte, the low nibble first) and `*_scales` uint8 [..., G] (an E8M0 power of
two per 32 values, bias 127). Tessera dequantizes them at load into the model's dtype
(exactly: every FP4 value times a power of two is a bf16 value), so the experts run on the
float MoE paths and take 4x their MXFP4 bytes; no linear layer gets a quantized method.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.quantization.base import LinearMethodBase
from engine.layers.quantization.checkpoint import QuantizationConfig

# e2m1: the sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            "(blocks [..., G, 16], scales [..., G])"
        )
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device=blocks.device)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    # one leading index (an expert) at a time: the float32 intermediates stay one expert's
    # (gpt-oss-120b's gate_up: 128 x 5760 x 2880 values a layer)
    for i in range(blocks.shape[0]) if blocks.dim() > 2 else [...]:
        b = blocks[i].to(torch.uint8)
        values = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1)
        exponents = scales[i].to(torch.int32) - 127
        out[i] = torch.ldexp(values.flatten(-2), exponents.unsqueeze(-1)).flatten(-2)
    return out


class Mxfp4Config(QuantizationConfig):
    name = "mxfp4"

    def __init__(self, skip: list[str]):
        self.skip = skip

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> Mxfp4Config:
        return cls(list(qcfg.get("modules_to_not_convert") or []))

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethodBase | None:
        return None  # MXFP4 holds experts only (engine.models.gpt_oss dequantizes them)

    def describe(self) -> str:
        return "MXFP4 experts dequantized at load to the model's dtype; other layers as stored"
