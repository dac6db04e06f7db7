"""The gated MLP: down(act(gate) * up) over a merged gate_up projection (SwiGLU; GeGLU)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import GATED_ACTIVATIONS
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """gate_up_proj -> SiluAndMul -> down_proj, or one fused call where gate_up's linear
    method has one for this call (w8a8's int8 path: one C pass between the two GEMMs)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"
    ):
        super().__init__()
        i = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [i, i], bias=bias)
        self.down_proj = RowParallelLinear(i, hidden_size, bias=bias)
        self.act = GATED_ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if not (gate_up.lora_active or down.lora_active):  # a LoRA step runs them one by one
            fused = gate_up.quant_method.apply_gated_mlp(gate_up, down, x)
            if fused is not None:
                return fused
        return down(self.act(gate_up(x)))
