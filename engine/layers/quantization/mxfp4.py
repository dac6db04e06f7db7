"""MXFP4 checkpoints (OpenAI's gpt-oss: quantization_config.quant_method "mxfp4").

Only the MoE experts are MXFP4 (the attention, router, embeddings and LM head stay bf16: the
config's modules_to_not_convert), each weight as a pair: `*_blocks` uint8 [..., G, 16] (two
FP4 e2m1 values a byte, the low nibble first) and `*_scales` uint8 [..., G] (an E8M0 power of
two per 32 values, bias 127; their decoding and GGUF repack: mxfp4_blocks). No linear layer
gets a quantized method; the experts either

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
from engine.layers.quantization.mxfp4_blocks import blocks_width, to_gguf_mxfp4


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
