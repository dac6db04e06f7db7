"""MXFP4 checkpoints (OpenAI's gpt-oss: quantization_config.quant_method "mxfp4").

Only the MoE experts are MXFP4 (the attention, router, embeddings and LM head stay bf16: the
config's modules_to_not_convert), each weight as a pair: `*_blocks` uint8 [..., G, 16] (two
FP4 e2m1 values a byte, the low nibble first) and `*_scales` uint8 [..., G] (an E8M0 power of
two per 32 values, bias 127). No linear layer gets a quantized method; the experts either

- dequantize at load into the model's dtype (exactly: every FP4 value times a power of two is
  a bf16 value), then run on the float MoE paths at 4x their MXFP4 bytes (CUDA, TP > 1), or
- on one CPU rank with the GGUF kernels, become GGUF MXFP4 blocks, the same bits with the
  nibbles reordered (to_gguf_mxfp4: 4.25 bits a weight, an eighth of float32's bytes), each
  routed expert on the GGUF dot kernels (engine/kernels/cpu/gguf.c: twice each e2m1 value is
  an int8 in [-12, 12], x as int8 per 32, as Q8_0's dots).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.layers.quantization.base import LinearMethodBase
from engine.layers.quantization.checkpoint import QuantizationConfig

# e2m1: the sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)


def _codes(blocks: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16] -> lut's value of each e2m1 code [..., G, 32], the low
    nibble of a byte first."""
    b = blocks.to(torch.uint8)
    return torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1).flatten(-2)


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
    parts = zip(blocks, scales, out, strict=True) if blocks.dim() > 2 else [(blocks, scales, out)]
    for b, s, o in parts:
        exponents = s.to(torch.int32) - 127
        o.copy_(torch.ldexp(_codes(b, lut), exponents.unsqueeze(-1)).flatten(-2))
    return out


GGUF_MXFP4_BLOCK_BYTES = 17  # ggml's block_mxfp4: the E8M0 byte, then 16 bytes of codes


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
    out = torch.empty(*blocks.shape[:-1], GGUF_MXFP4_BLOCK_BYTES, dtype=torch.uint8)
    for e in range(blocks.shape[0]):  # one expert's intermediates at a time
        b = blocks[e].to(torch.uint8)
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [rows, G, 32], in order
        out[e, ..., 0] = scales[e]
        out[e, ..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.flatten(-2)


class Mxfp4Experts:
    """A MoE layer's MXFP4 experts as GGUF MXFP4 blocks (see the module doc), where they can be:
    one CPU rank (no tensor or expert parallel slices), the GGUF kernels built and taking the
    layer's widths. add() collects both projections' MXFP4 pairs, then installs both as
    blocks (the layer's expert_linear runs them)."""

    def __init__(self, moe: nn.Module):
        from engine.kernels.cpu import gguf as cpu_gguf

        self.moe = moe
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        type_id = cpu_gguf.TYPES["MXFP4"] if cpu_gguf.available() else None
        widths = (moe.w13_weight.shape[2], moe.inter)  # H, I: the two GEMMs' in_features
        self.type_id = type_id
        self.eligible = (
            type_id is not None
            and moe.w13_weight.device.type == "cpu"
            and moe.tp_size == 1
            and moe.ep_size == 1
            and all(cpu_gguf.refusal(type_id, k) is None for k in widths)
        )

    def add(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """proj "gate_up" (rows gate | up) or "down"; once both are in, both are installed."""
        self.parts[proj] = (blocks, scales)
        if len(self.parts) < 2:
            return
        parts, self.parts = self.parts, {}
        q13, q2 = to_gguf_mxfp4(*parts["gate_up"]), to_gguf_mxfp4(*parts["down"])
        from types import SimpleNamespace

        from engine.layers.quantization.gguf import GGUFExperts

        moe = self.moe
        moe.w13_weight = nn.Parameter(q13, requires_grad=False)
        moe.w2_weight = nn.Parameter(q2, requires_grad=False)
        moe.expert_linear = GGUFExperts(
            SimpleNamespace(
                w13=q13, w2=q2, w13_type_id=self.type_id, w2_type_id=self.type_id,
                hidden_size=blocks_width(parts["gate_up"][0]),
                intermediate_size=blocks_width(parts["down"][0]),
            )
        )  # fmt: skip


def blocks_width(blocks: torch.Tensor) -> int:
    """The values a row of MXFP4 blocks [..., G, 16] holds."""
    return blocks.shape[-2] * 32


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
        return (
            "MXFP4 experts as GGUF MXFP4 blocks on one CPU rank, else dequantized at load to "
            "the model's dtype; other layers as stored"
        )
