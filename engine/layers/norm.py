"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import fused_ops as cpu_fused
from engine.layers import gpu_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fused = None  # cpu_fused, gpu_fused or False (the torch ops): decided at first use

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        if self.fused is None:
            fits = x.dim() == 2 and self.weight.dtype == x.dtype
            self.fused = next((k for k in (cpu_fused, gpu_fused) if fits and k.supports(x)), False)
        if (
            self.fused
            and x.dim() == 2
            and x.stride(-1) == 1
            and (residual is None or residual.stride(-1) == 1)
        ):
            out = self.fused.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = residual.add_(x)  # the residual stream is ours to update in place
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Like HF: normalise in float32, cast back, then scale by the weight in the model dtype.
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)
