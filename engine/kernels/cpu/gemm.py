"""y = x W^T (+ b) on CPU in plain C: bf16 or int8 weights, float32 arithmetic.

Why: on CPUs without native bf16 math (AVX2 machines, AMD EPYC before Zen 4), torch's bf16
matmul falls back to a slow path (measured here: 8-19 GFLOP/s on two cores at any batch),
while reading bf16 weights halves the memory traffic of float32 ones, which is what bounds
decode at small batches. This kernel widens each bf16 weight to float32 in registers (a
shift) and accumulates in float32 with FMA, so it runs at float32 speed with bf16 bytes.
int8 weights (engine.layers.quantization.int8) are widened the same way and scaled per row.

Blocking: the weight rows are split into blocks of NB rows over the threads. Small batches
(decode): tiles of 4 input rows x 3 weight rows keep 12 float32 accumulators in registers,
the input rows stay in L1 across the block and the block's weights in L2. From 48 input rows
(prefill, large decode batches): each block is widened once into float32 panels and 6 x 16
outer-product tiles run near the FMA units' peak. bf16 inputs are widened to float32 once
per call into a per-thread buffer.

On CPUs with AVX512-BF16, bf16 activations take the `_dp` kernels instead: bf16 pairs
multiplied with vdpbf16ps, no widening; batches of up to ROWS_MAX_M rows read the weight rows
one after another (one sequential stream: decode is bound by reading the weights), larger ones
run 4 x 6 register tiles. Up to how many rows they run is the instruction set's
(engine.kernels.cpu.isa): on CPUs with AMX-bf16 the tiles (engine.kernels.cpu.amx_bf16) take every
batch of more than one row.

torch's F.linear stays the reference: tests check this kernel against it. The kernel is
built with the other CPU kernels (engine/kernels/cpu/gemm.c); TESSERA_CPU_KERNELS=0 disables it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

import torch

from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import ops
from engine.kernels.cpu.build import cpu_flags

# Batches of up to this many rows stream the weights row by row (DEFINE_ROWS_DP).
ROWS_MAX_M = ops.ROWS_MAX_M


# (activation dtype, weight dtype) -> C function.
_FUNCS = {
    (torch.bfloat16, torch.bfloat16): "linear_bf16",
    (torch.float32, torch.float32): "linear_f32",
    (torch.bfloat16, torch.int8): "linear_i8_bf16",
    (torch.float32, torch.int8): "linear_i8_f32",
}

# bf16 activations on the AVX512-BF16 kernels, built only where the CPU has them.
_DP_FUNCS = {torch.bfloat16: "linear_bf16_dp", torch.int8: "linear_i8_bf16_dp"}
_dp_fn_cache: dict[torch.dtype, object] = {}


def _load() -> ctypes.CDLL | None:
    return ops.library()


def _dp_fn(weight_dtype: torch.dtype = torch.bfloat16):
    """The AVX512-BF16 kernel for bf16 activations and these weights, or None where the CPU
    lacks it."""
    if weight_dtype not in _dp_fn_cache:
        name = _DP_FUNCS.get(weight_dtype)
        _dp_fn_cache[weight_dtype] = ops.function(name) if name else None
    return _dp_fn_cache[weight_dtype]


def _native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AMX or AVX512-BF16): oneDNN is fast there."""
    flags = cpu_flags().split()
    return "amx_bf16" in flags or "avx512_bf16" in flags


_ALWAYS = sys.maxsize


def _max_rows_for_policy(policy: str, dtype: torch.dtype) -> int:
    if policy == "0":
        return 0
    if policy == "1":
        return _ALWAYS if dtype in (torch.bfloat16, torch.float32) else 0
    if policy != "auto":
        raise ValueError(f"TESSERA_CPU_GEMM must be auto, 0 or 1; got {policy!r}")
    # auto: float32 stays with torch (MKL/oneDNN), which this kernel does not beat on every
    # CPU; bf16 takes the kernel at every batch where torch has no native bf16 path, and at
    # small batches where the AVX512-BF16 kernel exists.
    if dtype != torch.bfloat16:
        return 0
    if not _native_bf16():
        return _ALWAYS
    # how far the AVX512-BF16 kernel beats what runs above it is the CPU's: cpu_isa
    return cpu_isa.plan().dp_max_rows if _dp_fn() is not None else 0


def max_rows_for(weight: torch.Tensor) -> int:
    """The largest batch (rows of x) for which a layer with this weight uses the kernel; 0:
    never. TESSERA_CPU_GEMM: auto (the default; see _max_rows_for_policy), 1 (every batch,
    every supported dtype), 0 (never). Layers ask once, at their first forward."""
    if not (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()):
        return 0
    if _load() is None:
        return 0
    return _max_rows_for_policy(os.environ.get("TESSERA_CPU_GEMM", "auto"), weight.dtype)


def available(dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel is built and handles these dtypes (whatever the policy says)."""
    return (dtype, weight_dtype or dtype) in _FUNCS and _load() is not None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    *,
    allow_dp: bool = True,
) -> torch.Tensor:
    """F.linear(x, weight, bias) on CPU, x bfloat16 or float32, weight [N, K] contiguous of
    x's dtype, or int8 with weight_scale (float32 [N]: row n is weight[n] * weight_scale[n]).
    bf16 activations run on the AVX512-BF16 kernels where the CPU has them (allow_dp=False:
    the widening kernels, which tests use to cover both). Falls back to torch where the kernel
    cannot take the call."""
    lib = _load()
    n, k = weight.shape
    x2 = x.reshape(-1, k) if x.dim() != 2 else x
    fn = _FUNCS.get((x.dtype, weight.dtype))
    if (
        lib is None
        or fn is None
        or x2.stride(-1) != 1
        or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))
        or (weight.dtype == torch.int8) != (weight_scale is not None)
    ):
        return _torch_linear(x, weight, bias, weight_scale)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    if m:
        scale_ptr = None
        if weight_scale is not None:
            assert weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
            scale_ptr = weight_scale.data_ptr()
        call = getattr(lib, fn)
        if allow_dp and x.dtype == torch.bfloat16:
            call = _dp_fn(weight.dtype) or call
        rc = call(
            x2.data_ptr(), x2.stride(0), m, k, weight.data_ptr(), scale_ptr, n,
            None if bias is None else bias.data_ptr(), y.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            return _torch_linear(x, weight, bias, weight_scale)
    return y.view(*x.shape[:-1], n)


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) for a weight made for this call (a quantized layer's large batch
    on its dequantized copy): the kernel where the policy takes this many rows (every batch on
    CPUs without native bf16, whose torch bf16 matmul is ~10x slower), else F.linear."""
    if x.numel() <= max_rows_for(weight) * x.shape[-1]:
        return linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def dense_by_slices(
    x: torch.Tensor,
    n: int,
    dequantize_rows: Callable[[int, int, torch.Tensor | None], torch.Tensor],
    bias: torch.Tensor | None,
    slice_bytes: int,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for a quantized weight W [n, K] on dense_linear, W dequantized
    by dequantize_rows(r0, r1, out) (rows r0:r1 in x's dtype, into out where it is not None) at
    most slice_bytes of rows at a time (slices of a multiple of 64 rows), each slice's outputs
    in place: a bounded transient however large the weight."""
    k = x.shape[-1]
    step = max(64, slice_bytes // (k * x.element_size()) // 64 * 64)
    bias = None if bias is None else bias.to(x.dtype)
    if step >= n:
        return dense_linear(x, dequantize_rows(0, n, None), bias)
    x2 = x.reshape(-1, k)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    buffer = torch.empty(step, k, dtype=x.dtype)  # one slice's weight, reused: no fresh pages
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = dequantize_rows(r0, r1, buffer[: r1 - r0])
        y[:, r0:r1] = dense_linear(x2, w, None if bias is None else bias[r0:r1])
    return y.view(*x.shape[:-1], n)


def _torch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
) -> torch.Tensor:
    if weight_scale is not None:  # slow, but right: dequantize, then multiply
        weight = (weight.float() * weight_scale[:, None]).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)
