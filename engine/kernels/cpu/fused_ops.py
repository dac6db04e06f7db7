"""Fused CPU kernels: RMSNorm with its residual add, SiLU-and-mul, rotary embedding.

Why: a decode step of a small model at low batch is hundreds of small torch ops driven from
Python, each a few microseconds of dispatch for a few hundred elements of work. RMSNorm with
a residual is nine of them (add, float, pow, mean, add, rsqrt, mul, cast, mul); here it is
one call: 46 -> 12 us for one 576-wide bf16 row, 77 -> 30 us for 32 rows (measured on two
AVX2 cores; two norms per layer). SiLU-and-mul and rotary in C are no faster than torch's
alone; they are here to keep decode-sized calls on the calling thread (see PAR_ROWS in the
source), which raised 32-stream serving throughput from 535 to ~600 tokens/s on a 2-core
Zen 5. The arithmetic follows the torch path step for step, rounding to the model dtype
where it does: the torch path stays the reference and tests check these kernels against it.
Built with the other CPU kernels (engine/kernels/cpu/fused_ops.c); TESSERA_CPU_KERNELS=0
disables them.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu import build, ops

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _load() -> ctypes.CDLL | None:
    return ops.library()


def available() -> bool:
    """Whether the kernels are on: built, and TESSERA_CPU_KERNELS not 0 (asked once, when the
    layers' ops are bound to the CPU: engine.layers.ops)."""
    return build.kernels_enabled() and _load() is not None


def fits(x: torch.Tensor) -> bool:
    """Whether rms_norm / silu_and_mul take x, the kernels being on: a float32/bfloat16
    [T, H] with unit last stride (on the CPU)."""
    return x.dtype in _SUFFIX and x.dim() == 2 and x.stride(-1) == 1


def supports(x: torch.Tensor) -> bool:
    """Whether these kernels take x: a CPU float32/bfloat16 tensor with unit last stride."""
    return x.device.type == "cpu" and fits(x) and _load() is not None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] -> norm(x) * weight; with residual: residual += x in place, then its norm.
    Call only where supports(x) (and the residual's) holds."""
    rows, h = x.shape
    out = torch.empty(rows, h, dtype=x.dtype)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1
    assert weight.dtype == x.dtype and weight.is_contiguous()
    lib = _load()
    assert lib is not None, "the CPU kernels are unavailable (see supports)"
    getattr(lib, f"rmsnorm_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(), out.data_ptr(), h, rows, h, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]. Call only where supports(x)."""
    rows, two_i = x.shape
    out = torch.empty(rows, two_i // 2, dtype=x.dtype)
    lib = _load()
    assert lib is not None, "the CPU kernels are unavailable (see supports)"
    getattr(lib, f"silu_mul_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), out.data_ptr(), two_i // 2, rows, two_i // 2,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """ApplyRotary (engine.layers.rotary) in one C call: x [T, heads, D] (heads D apart, unit
    last stride), cos/sin [T, 1, D/2] contiguous, all one dtype -> a new contiguous
    [T, heads, D]. None where the kernel cannot take these tensors (the caller runs torch)."""
    if x.dtype not in _SUFFIX or x.device.type != "cpu" or x.dim() != 3:
        return None
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or d % 2:
        return None
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.numel() == t * d // 2):
        return None
    lib = _load()
    if lib is None:
        return None
    out = torch.empty(t, heads, d, dtype=x.dtype)
    getattr(lib, f"rope_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, heads, d,
        torch.get_num_threads(),
    )  # fmt: skip
    return out
