"""Rotary position embedding (HF "rotate half" layout) with a precomputed cos/sin cache.

The model looks cos/sin up once per step (RotaryEmbedding.lookup) and every attention layer
applies them with its ApplyRotary op, so no layer recomputes frequencies. Supports rope_type
"default", "llama3" and "longrope" (Phi-3 / Phi-4), and rotary on the first rotary_dim dims of
each head only (partial_rotary_factor: the model rotates that slice, the rest passes through),
and "yarn" (gpt-oss; Qwen2.5 / Qwen3 configs that enable it for long contexts): static, as
transformers applies it, the same frequencies for every position, cos and sin scaled by the
attention factor.

LongRoPE: transformers picks the short factors while a forward's largest position is below
original_max_position_embeddings and the long ones beyond it, for the whole forward (and keeps
the keys it cached before). Here the choice is per position: positions below
original_max_position_embeddings take the short factors, later ones the long factors. That
is HF's rotation, token for token, for every prompt up to original_max_position_embeddings,
decoding past it included (HF's decode steps there rotate only the new token, with the long
factors; the cached keys keep the short ones); a longer prompt keeps the short factors for
its first original_max_position_embeddings positions, where HF re-rotates the whole prompt with
the long ones. A position's rotation never depends on the batch or the request, so the prefix
cache, chunked prefill and preemption stay exact. Both sets are scaled by the attention factor
(sqrt(1 + log(factor) / log(original)) unless the config gives attention_factor), as HF scales
cos and sin.
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


def longrope_parameters(
    dim: int, base: float, scaling: dict
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short inv_freq, long inv_freq, attention factor) of a "longrope" scaling dict over
    rotary dim dim: transformers' _compute_longrope_parameters, both factor sets. scaling
    holds short_factor, long_factor, original_max_position_embeddings and factor
    (engine.models.hf_config fills factor in as max_position_embeddings / original when the
    config has none)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ValueError(
                f"rope_scaling {key} has {ext.numel()} entries; the rotary dimension "
                f"({dim}) needs {dim // 2}"
            )
        inv.append(1.0 / (ext * base**shape))
    return inv[0], inv[1], float(attention_factor)


def yarn_parameters(dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of a "yarn" scaling dict over rotary dim dim:
    transformers' _compute_yarn_parameters. scaling holds factor and
    original_max_position_embeddings (engine.models.hf_config fills factor in as
    max_position_embeddings / original when the config has none), optionally beta_fast /
    beta_slow (32 / 1), mscale / mscale_all_dim, attention_factor and truncate (True)."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:  # the YaRN paper's Eq. 21
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # 1: the dim keeps its frequency; 0: interpolated by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to max_position over rotary_dim (default head_dim)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        if rope_type not in (None, "default", "linear", "llama3", "longrope", "yarn"):
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported "
                "(supported: default, linear, llama3, longrope, yarn)"
            )
        self.head_dim = head_dim
        dim = self.rotary_dim = rotary_dim or head_dim
        if dim % 2 or dim > head_dim:
            raise ValueError(f"rotary dimension {dim} must be even and at most head_dim {head_dim}")
        t = torch.arange(max_position, dtype=torch.float32)
        if rope_type == "longrope":
            short, long, attention_factor = longrope_parameters(dim, base, rope_scaling)
            original = int(rope_scaling["original_max_position_embeddings"])
            freqs = torch.cat(  # [P, D/2]: short factors below original, long ones from it
                (torch.outer(t[:original], short), torch.outer(t[original:], long))
            )
            cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        elif rope_type == "yarn":
            inv_freq, attention_factor = yarn_parameters(dim, base, rope_scaling)
            freqs = torch.outer(t, inv_freq)
            cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            if rope_type == "llama3":
                inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
            elif rope_type == "linear":  # positions divided by the factor (Gemma 3's global layers)
                inv_freq = inv_freq / float(rope_scaling["factor"])
            freqs = torch.outer(t, inv_freq.float())  # [P, D/2], float32 like HF
            cos, sin = freqs.cos(), freqs.sin()
        # Not a state-dict buffer: it is derived from the config, never loaded.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

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
