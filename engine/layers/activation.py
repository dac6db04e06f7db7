"""SwiGLU activation over a merged gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import fused_ops as cpu_fused
from engine.layers import gpu_fused


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_fused.supports(x):  # one C call, on the calling thread for decode batches
            return cpu_fused.silu_and_mul(x)
        if x.dim() == 2 and gpu_fused.supports(x):  # one kernel for SiLU and the product
            return gpu_fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
