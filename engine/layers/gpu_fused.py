"""The layers' fused Triton kernels on CUDA: RMSNorm with its residual add, rotary embedding,
SiLU-and-mul (engine/kernels/triton/fused_ops.py), where the torch ops launch 9, 7 and 2
kernels. They round where the torch path rounds, which stays the reference (the tests hold
them to it). TESSERA_GPU_FUSED=0 runs the torch ops instead; without triton they are off.
"""

from __future__ import annotations

import functools
import os

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _kernels():
    if os.environ.get("TESSERA_GPU_FUSED") == "0":
        return None
    try:  # imports triton: never on a CPU-only path
        from engine.kernels.triton import fused_ops
    except ImportError:
        return None
    return fused_ops


def supports(x: torch.Tensor) -> bool:
    """Whether these kernels take x: a CUDA float tensor with unit last stride."""
    return x.is_cuda and x.dtype in _DTYPES and x.stride(-1) == 1 and _kernels() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] -> norm(x) * weight; with residual: residual += x in place, then its norm.
    Call only where supports(x) (and the residual's) holds."""
    return _kernels().rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _kernels().silu_and_mul(x)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """RotaryEmbedding.apply in one kernel: x [T, heads, D], cos/sin [T, 1, D/2] contiguous
    in x's dtype -> a new contiguous [T, heads, D]; None where the kernel cannot take them."""
    if x.dim() != 3 or not supports(x) or x.shape[-1] % 2:
        return None
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    if not (
        cos.is_contiguous() and sin.is_contiguous() and cos.numel() * 2 == x.shape[0] * x.shape[2]
    ):
        return None
    return _kernels().rope(x, cos, sin)
