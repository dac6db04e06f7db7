"""What the w4 kernel's tests share: which variant this build has, and x as it reads it."""

from __future__ import annotations

import torch

from engine.kernels.cpu import ops
from engine.kernels.cpu import w4 as cpu_w4


def avx2_variant() -> bool:
    """The AVX2 kernel (w4_avx2.c) takes any batch; the AVX512-VNNI one 12 rows."""
    return cpu_w4.max_rows() > ops.W4_MAX_ROWS


def x_as_the_kernel_reads_it(x: torch.Tensor) -> torch.Tensor:
    """The AVX2 kernel's x: int8 per group of 32 with scale amax / 127, rounded to nearest
    even, as float64 (the VNNI kernel's int16 per row is within the test's tolerance of x)."""
    return x_int8_per_group(x) if avx2_variant() else x.double()


def x_int8_per_group(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as int8 per group of 32 (scale amax / 127, to nearest even) back in float64:
    what the AVX2 kernel and the AVX512-VNNI batch kernel multiply."""
    g = x.double().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127 / amax, 0)).clamp(-127, 127)
    return (q * (amax.float() / 127).double()).view_as(x)
