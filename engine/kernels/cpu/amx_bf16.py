"""y = x W^T (+ b) on AMX-bf16 tiles (engine/kernels/cpu/amx_bf16.c), for batches of bf16 rows.

Why: on CPUs with AMX (Intel Sapphire Rapids and later) one tdpbf16ps multiplies 16 rows x 32
k of x with 32 k x 16 columns of W (8,192 bf16 products, float32 sums) in 16 cycles: 16x an
AVX512-BF16 vdpbf16ps's work. From a few rows up that beats the `_dp` kernels (cpu_gemm), whose
cost grows with the rows, and oneDNN's F.linear, which has a fixed cost per call that the
small matrices of a model like SmolLM2-135M never amortize. One-row decode stays on the dot
kernels (cpu_gemm, cpu_w4, cpu_gguf): the tile setup and the 16-row tiles are wasted there.
engine.kernels.cpu.isa picks the rows where each kernel takes over, per instruction set. On two
cores of a Xeon with AMX, SmolLM2-135M's bf16 decode step at 32 rows: 90.5 -> 39.3 ms (its
121 GEMMs 69.5 -> 17.9 ms; the LM head 13.6 -> 3.1 ms).

One GEMM, three weight sources. Pairs of 16-output tiles (32 outputs) are split over the
threads; each thread brings its pair's weights into tile form once and runs every 32 rows of
x over them, in four 16 x 16 float32 sum tiles:
  - linear: bf16 weights [N, K] as they are (no second copy): 16 weight rows are the A operand
    of tdpbf16ps as they lie in memory, and x, rearranged once per call into B tiles (pairs
    of k interleaved, 16 rows of x a tile), the other; the sums come out transposed and are
    turned back on the way out. Measured against a packed copy of W in the B layout (x as A):
    equal within noise at 1-32 rows, 3-7% slower at 64-128, so no packed copy is kept;
  - linear_gguf: GGUF rows of any type gguf_dequant_row reads (cpu_gguf's large batches), the
    same A operand decoded 16 rows at a time into a buffer in L1/L2, instead of the whole
    weight into memory then F.linear;
  - linear_w4: cpu_w4's 4-bit tiles (16 rows, groups of 32: one group is exactly one B tile of
    W, codes already in its order), decoded into a buffer in L2 (GGUF Q4_0/Q4_1 repacked into
    w4 tiles, w4a8); here x is the A operand as it lies. The next pair is decoded inside the
    current pair's tile loop (vector units and tile unit side by side: the 120 GEMMs of a
    step 18-23% faster at 16-128 rows), and prefill-sized x is taken in blocks that fit in L2.
Weights are rounded to bf16 where they are not bf16 already (as cpu_gguf's dequantized copy
was). K not a multiple of 32 and the last tiles of rows go through zero-padded copies;
outputs past N are masked on the way out.

Without AMX-bf16 (the build's -march=native, or Linux refusing the tile state: arch_prctl),
or with TESSERA_AMX=0, available() is False and every function answers None: the callers keep
their other paths. torch's F.linear on the same bf16 values in float32 is the tests' reference.
"""

from __future__ import annotations

import os

import torch

from engine.kernels.cpu import ops

K_CHUNK = 32  # k per B tile

_on: list[bool] = []  # decided once per process


def available() -> bool:
    """Whether the AMX-bf16 GEMMs run here (built, permitted, not turned off by TESSERA_AMX=0)."""
    if not _on:
        fn = ops.function("amx_bf16_enabled")
        _on.append(os.environ.get("TESSERA_AMX") != "0" and fn is not None and bool(fn()))
    return _on[0]


def _rows(x: torch.Tensor, k: int, bias: torch.Tensor | None):
    """x as [M, K] bf16 rows with unit stride and bias as bf16, or None where AMX cannot take
    the call."""
    if not available() or x.dtype != torch.bfloat16 or x.shape[-1] != k or x.device.type != "cpu":
        return None
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    return x2, bias


def _call(fn_name: str, x: torch.Tensor, x2, bias, n: int, out_dtype, *weight_args):
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        return None
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype)
    rc = ops.function(fn_name)(
        x2.data_ptr(), x2.stride(0), m, x2.shape[1], *weight_args, n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), n,
        int(out_dtype == torch.float32), torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else y.view(*x.shape[:-1], n)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """x [..., K] bf16 @ weight^T (+ bias) for a bf16 weight [N, K] (contiguous), out_dtype bf16
    (default) or float32; None where AMX cannot take the call."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        return None
    r = _rows(x, weight.shape[1], bias)
    if r is None:
        return None
    return _call("amx_bf16_linear", x, r[0], r[1], weight.shape[0], out_dtype, weight.data_ptr())


def linear_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """argmax over the outputs of x [M, K] bf16 @ weight^T (bf16 [N, K], contiguous) per row,
    int64 [M], the first maximum winning: the argmax of linear(x, weight) (the same sums,
    rounded to bf16), without those outputs in memory. None where AMX cannot take it."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
        return None
    r = _rows(x, weight.shape[1], None)
    if r is None:
        return None
    x2 = r[0]
    idx = torch.empty(x2.shape[0], dtype=torch.int64)
    rc = ops.function("amx_bf16_linear_argmax")(
        x2.data_ptr(), x2.stride(0), x2.shape[0], x2.shape[1], weight.data_ptr(),
        weight.shape[0], idx.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else idx


def linear_w4(
    x: torch.Tensor,
    tiles: torch.Tensor,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """x [..., K] bf16 against 4-bit w4 tiles (cpu_w4.Q4Weight.data: uint8 [tiles, K / 32 *
    320]); None where AMX cannot take the call (K % 32, no AMX)."""
    r = _rows(x, in_features, bias)
    if r is None or in_features % K_CHUNK or not tiles.is_contiguous():
        return None
    return _call("amx_bf16_linear_w4", x, r[0], r[1], out_features, out_dtype, tiles.data_ptr())


def gated_w4(
    x: torch.Tensor, tiles: torch.Tensor, intermediate: int, in_features: int
) -> torch.Tensor | None:
    """silu(gate) * up [..., I] for x [..., K] bf16 against the w4 tiles of a merged gate_up
    projection (2 I rows, gate then up, I % 16 == 0), in one pass: gate tile p meets up tile
    I / 16 + p in the tile loop and the epilogue writes their product, rounded as gate_up's
    outputs and SiluAndMul round (the [rows, 2 I] outputs are never stored). None where AMX
    cannot take the call."""
    r = _rows(x, in_features, None)
    if r is None or in_features % K_CHUNK or intermediate % 16 or not tiles.is_contiguous():
        return None
    x2 = r[0]
    m = x2.shape[0]
    y = torch.empty(m, intermediate, dtype=torch.bfloat16)
    rc = ops.function("amx_bf16_gated_w4")(
        x2.data_ptr(), x2.stride(0), m, in_features, tiles.data_ptr(), intermediate,
        y.data_ptr(), intermediate, torch.get_num_threads(),
    )  # fmt: skip
    return None if rc != 0 else y.view(*x.shape[:-1], intermediate)


def linear_gguf(
    x: torch.Tensor,
    blocks: torch.Tensor,
    type_id: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """x [..., K] bf16 against GGUF rows (uint8 [N, row bytes], a type gguf_dequant_row
    reads); None where AMX cannot take the call."""
    r = _rows(x, in_features, bias)
    if r is None or not blocks.is_contiguous():
        return None
    return _call("amx_bf16_linear_gguf", x, r[0], r[1], blocks.shape[0], out_dtype,
                 blocks.data_ptr(), blocks.shape[1], type_id)  # fmt: skip
