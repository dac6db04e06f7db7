"""RMSNorm (with the residual add before it), rotary embedding and SiLU-and-mul, one kernel
each.

In torch ops these are 9, 7 and 2 kernels (upcast, square, mean, rsqrt, ...; four products,
a sum, a difference, a concatenation; SiLU, then the product). On a GPU each costs a launch:
in an eager step that is host time per layer, and inside a captured decode graph, where a
small batch's kernels take a few microseconds each, it is most of what the step spends
outside the matmuls.

They round where the torch forms round, so on a GPU they give the torch path's values (the
norm's sum of squares aside, which is reduced in another order): the residual sum in the
model's dtype, normalized in fp32, cast, then scaled by the weight in the model's dtype; each
rotary product rounded, then their sum or difference; SiLU's output rounded, then the
product. Under the interpreter the casts to bf16 truncate instead (see the package's
docstring): within an ulp a rounding there.

The layers' ops (engine/layers/norm.py, activation.py, rotary.py) call them once bound to CUDA
(engine/layers/ops.py), for the tensors fits / rope_fits accept, and run the torch ops for
the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fits(x: torch.Tensor) -> bool:
    """Whether rms_norm / silu_and_mul take x: a float [T, H] with unit last stride."""
    return x.dtype in DTYPES and x.dim() == 2 and x.stride(-1) == 1


def rope_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether rope takes these: x [T, heads, D] (D even, unit last stride), cos/sin
    [T, 1, D/2] contiguous in x's dtype."""
    return (
        x.dim() == 3
        and x.dtype in DTYPES
        and x.stride(-1) == 1
        and x.shape[-1] % 2 == 0
        and cos.dtype == x.dtype
        and sin.dtype == x.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.numel() * 2 == x.shape[0] * x.shape[2]
    )


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    stride_x,
    res_ptr,
    stride_res,
    w_ptr,
    out_ptr,
    stride_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # residual += x, in the model's dtype, as the torch path's add_
        res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
        summed = (x + res).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, summed, mask=ok)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, 0) / hidden
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] (unit last stride) -> norm(x) * weight, a new tensor; with residual [T, H]:
    residual += x in place first, and its norm is returned."""
    rows, hidden = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.numel() == hidden
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x, x.stride(0),
        x if residual is None else residual, 0 if residual is None else residual.stride(0),
        weight, out, out.stride(0), hidden, float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return out


@triton.jit
def _rope_kernel(
    x_ptr,
    stride_xt,
    stride_xh,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    ok = (h < heads) & (d < HALF)
    src = x_ptr + t * stride_xt + h * stride_xh + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # each product rounded to the model's dtype, then the sum: what the torch ops compute
    x1c = (x1 * cos).to(dtype).to(tl.float32)
    x2s = (x2 * sin).to(dtype).to(tl.float32)
    x2c = (x2 * cos).to(dtype).to(tl.float32)
    x1s = (x1 * sin).to(dtype).to(tl.float32)
    dst = out_ptr + (t * heads + h) * (2 * HALF) + d
    tl.store(dst, (x1c - x2s).to(dtype), mask=ok)
    tl.store(dst + HALF, (x2c + x1s).to(dtype), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (unit last stride, any token and head strides: a view of a fused QKV
    output), cos/sin [T, 1, D/2] contiguous, in x's dtype -> a new contiguous [T, heads, D]
    rotated as RotaryEmbedding.apply_torch rotates it (halves, not interleaved pairs)."""
    t, heads, d = x.shape
    assert x.stride(-1) == 1 and d % 2 == 0
    assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == t * d // 2
    out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    half = d // 2
    _rope_kernel[(t,)](
        x, x.stride(0), x.stride(1), cos, sin, out, heads,
        HALF=half,
        HEADS_PAD=triton.next_power_of_2(heads),
        HALF_PAD=triton.next_power_of_2(half),
    )  # fmt: skip
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, stride_x, out_ptr, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] (unit last stride) -> silu(gate) * up, a new [T, I]."""
    rows, width = x.shape
    assert x.stride(-1) == 1 and width % 2 == 0
    inter = width // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x, x.stride(0), out, out.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out
