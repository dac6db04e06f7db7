"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import fused_ops as cpu_fused
from engine.layers.ops import CustomOp, triton_fused


class RMSNorm(CustomOp):
    """norm(x), or with a residual: (norm(x + residual), x + residual), the residual updated
    in place. One C call on the CPU, one Triton kernel on CUDA (engine.layers.ops binds them)
    for [T, H] rows with unit last stride in the weight's dtype; else the torch ops."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = residual.add_(x)  # the residual stream is ours to update in place
        return self._norm(residual), residual

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._fused(cpu_fused, x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._fused(triton_fused(), x, residual)

    def _fused(self, kernels, x: torch.Tensor, residual: torch.Tensor | None):
        """One kernel call where it takes these tensors (the C or the Triton module)."""
        weight = self.weight  # (a module attribute lookup costs more than the checks)
        if (
            x.dtype is not weight.dtype
            or not kernels.fits(x)
            or (residual is not None and residual.stride(-1) != 1)
        ):
            return self.forward_native(x, residual)
        out = kernels.rms_norm(x, weight, self.eps, residual)
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Like HF: normalise in float32, cast back, then scale by the weight in the model dtype.
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)
