"""Rotary position embedding (HF "rotate half" layout) with a precomputed cos/sin cache.

The model looks cos/sin up once per step (RotaryEmbedding.lookup) and every attention layer
applies them with its ApplyRotary op, so no layer recomputes frequencies. Supports rope_type
"default" and "llama3".
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.kernels.cpu import fused_ops as cpu_fused
from engine.layers.ops import CustomOp, triton_fused


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Same formula as transformers' _compute_llama3_parameters.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = int(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
    ):
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        if rope_type not in (None, "default", "llama3"):
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported (supported: default, llama3)"
            )
        self.head_dim = head_dim
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [P, D/2], float32 like HF
        # Not a state-dict buffer: it is derived from the config, never loaded.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D/2] in dtype, for every token of the step."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference for the kernels (ApplyRotary's native forward)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class ApplyRotary(CustomOp):
    """Rotate x [T, heads, D] (any heads: q and k can be rotated together) by the cos/sin of
    RotaryEmbedding.lookup: one C call on the CPU, one Triton kernel on CUDA, where they take
    the tensors (engine.layers.ops binds them); else the torch ops. Holds no state."""

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return RotaryEmbedding.apply_torch(x, cos, sin)

    def forward_cpu(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = cpu_fused.rope(x, cos, sin)  # None: the kernel cannot take these tensors
        return self.forward_native(x, cos, sin) if out is None else out

    def forward_cuda(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kernels = triton_fused()
        if kernels.rope_fits(x, cos, sin):
            return kernels.rope(x, cos, sin)
        return self.forward_native(x, cos, sin)
