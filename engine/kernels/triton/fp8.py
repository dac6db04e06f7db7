"""Dynamic per-token fp8 (e4m3) quantization of activations: one program per row.

Row m's scale is max|x[m]| * (1 / 448) (at least MIN_SCALE: an all-zero row stays finite) and
its values x / scale, saturated to +-448 and rounded to nearest even: the bytes and scales
engine.kernels.fp8.per_token_quant_fp8_torch gives on either device (the scale a product with
the fp32 reciprocal, which is what torch's division by a Python scalar computes on CUDA; the
values an IEEE division, tl.math.div_rn, not Triton's approximate `/`). In torch that is five
kernels and an fp32 copy of x (upcast, abs, amax, divide, cast); here one read of x for the
maximum and one for the values (small rows: one, held in registers), one byte written a value.

The bytes are formed with integer ops and stored through a uint8 view (kv_store's
_e4m3_bits): the interpreter's float8 cast rounds half up, so the tests would otherwise check
other code than a GPU runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.kv_store import _e4m3_bits

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # a product, as torch's division by a scalar is on CUDA
MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's floor for a dynamic scale
MAX_BLOCK = 4096  # a row up to this wide is read once


@triton.jit
def _per_token_quant_kernel(
    x_ptr,
    stride_x,
    out_ptr,
    stride_out,
    scale_ptr,
    K,
    min_scale,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    src = x_ptr + row * stride_x
    dst = out_ptr + row * stride_out
    if ONE_PASS:
        ok = cols < K
        x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        amax_acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ok = k0 + cols < K
            x = tl.load(src + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            amax_acc = tl.maximum(amax_acc, tl.abs(x))
        amax = tl.max(amax_acc, 0)
    scale = tl.maximum(amax * INV_FP8_MAX, min_scale)
    tl.store(scale_ptr + row, scale)
    if ONE_PASS:
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(dst + cols, _e4m3_bits(v).to(tl.uint8), mask=ok)
    else:
        for k0 in range(0, K, BLOCK):
            ok = k0 + cols < K
            x = tl.load(src + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
            tl.store(dst + k0 + cols, _e4m3_bits(v).to(tl.uint8), mask=ok)


def per_token_quant_fp8(
    x: torch.Tensor, min_scale: float = MIN_SCALE, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit last stride) -> (float8_e4m3fn [M, K], fp32 scales [M, 1]) with
    x ~= q * scale. block: the row chunk (tests; default: the row, up to MAX_BLOCK)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return out, scales
    if block is None:
        block = min(MAX_BLOCK, triton.next_power_of_2(max(k, 16)))
    _per_token_quant_kernel[(m,)](
        x, x.stride(0), out.view(torch.uint8), out.stride(0), scales, k, float(min_scale),
        BLOCK=block,
        ONE_PASS=block >= k,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, scales
