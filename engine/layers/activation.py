"""SwiGLU activation over a merged gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cpu import fused_ops as cpu_fused
from engine.layers.ops import CustomOp, triton_fused


class SiluAndMul(CustomOp):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_fused.fits(x):  # one C call, on the calling thread for decode batches
            return cpu_fused.silu_and_mul(x)
        return self.forward_native(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        kernels = triton_fused()
        if kernels.fits(x):  # one kernel for SiLU and the product
            return kernels.silu_and_mul(x)
        return self.forward_native(x)


class GeluTanhAndMul(CustomOp):
    """x = [gate | up] -> gelu(gate, tanh approximation) * up: GeGLU (Gemma's
    gelu_pytorch_tanh). The torch ops on every device."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


class SwigluOAIAndMul(CustomOp):
    """x = [gate | up] -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
    g = clamp(gate, max=limit): gpt-oss's experts (transformers' GptOssExperts._apply_gate,
    its gate and up de-interleaved into halves at load). The torch ops on every device."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# config.json's hidden_act -> the gated MLP's activation
GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
