"""FP8 (e4m3) linear layers: y = x @ W.T + b with W [N, K] held as float8_e4m3fn and scales.

Three paths, chosen by the device:

- CUDA with FP8 tensor cores (capability >= 8.9: Ada, Hopper and later): W8A8 through
  torch._scaled_mm. The activations are quantized too: with a static per-tensor
  `input_scale` (from the checkpoint) as x / input_scale, otherwise dynamically per token
  (row m's scale max|x[m]| / 448), by a Triton kernel (engine.kernels.triton.fp8: one launch
  instead of torch's five) or, without Triton, in torch. Both scales scalar: _scaled_mm's
  tensorwise mode, any output dtype; otherwise its rowwise mode (scale_a [M, 1], scale_b
  [1, N], a per-tensor scale broadcast), which gives bf16 (an fp16 model's output is cast).
  _scaled_mm wants K and N multiples of 16; other shapes take the weight-only path.
- CUDA without FP8 (Ampere and older): weight-only. `Fp8Linear` dequantizes W to the
  model's dtype once, at load, and runs a dense matmul (twice the weight memory of fp8, the
  speed of the unquantized model); the functional fp8_linear dequantizes per call.
- CPU: the same weight-only form, dequantized per call: a reference, so the format is
  testable without a GPU, not a fast path.

The weight-only paths do not quantize the activations (an input_scale is then unused): they
are more exact than W8A8, not bit-equal to it. fp8_linear_reference is W8A8's exact math in
fp32 (the activations quantized the way the fp8 path quantizes them), which the _scaled_mm
path is tested against.

`quantize_weight_fp8` is `--quantization fp8` on a bf16/fp16 checkpoint: per output channel,
scale = max|W[n]| / 448, computed once at load.

This module imports Triton only when it first quantizes activations on CUDA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # the floor of a dynamic scale (an all-zero row)


def supports_fp8_matmul(device: torch.device | str) -> bool:
    """torch._scaled_mm on this device: CUDA capability 8.9 or later."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _capability(index) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _as_scale(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(scale, dtype=torch.float32, device=device)


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (float8_e4m3fn [N, K], fp32 scales [N]), per output
    channel: W[n] ~= q[n] * scale[n], scale[n] = max|W[n]| / 448 (MIN_SCALE for a zero row)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(
    w_fp8: torch.Tensor, w_scale: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """float8 [N, K] with a per-tensor scale (a scalar) or per-channel scales [N] (or [N, 1])
    -> W [N, K] in dtype (the product in fp32, rounded once)."""
    scale = _as_scale(w_scale, w_fp8.device)
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)
    return (w_fp8.float() * scale).to(dtype)


def expand_block_scales(scales: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """A block-FP8 checkpoint's scales [ceil(rows / block_n), Kb] -> one row of them per
    output row, float32 [rows, Kb] (the last block may be partial). Row-wise scales let merged
    layers (q|k|v, gate|up) stack parts whose rows are not block multiples, and let a column-
    parallel shard start anywhere."""
    blocks = -(-rows // block_n)
    if scales.dim() != 2 or scales.shape[0] != blocks:
        raise ValueError(
            f"block scales of shape {tuple(scales.shape)} for {rows} rows in blocks of "
            f"{block_n}: expected {blocks} rows of them"
        )
    return scales.float().repeat_interleave(block_n, dim=0)[:rows]


def dequantize_fp8_blocks(
    w_fp8: torch.Tensor, row_scales: torch.Tensor, block_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """float8 [N, K] with row-wise block scales [N, ceil(K / block_k)] (expand_block_scales)
    -> W [N, K] in dtype: each value times its block's scale in fp32, rounded once (the
    reference the block-FP8 GEMM is tested against, and the CPU's form of the weight)."""
    k = w_fp8.shape[-1]
    scale = row_scales.float().repeat_interleave(block_k, dim=-1)[..., :k]
    return (w_fp8.float() * scale).to(dtype)


def per_token_quant_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, 1]): scale = max|x[m]| * (1 / 448)
    (at least MIN_SCALE), values x / scale rounded to nearest even. The reference of the Triton
    kernel, and its fallback."""
    xf = x.float()
    # a product with the reciprocal (not a division): the same fp32 scale on CPU and CUDA,
    # where torch divides by a Python scalar that way, and in the Triton kernel
    scale = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: the Triton kernel on CUDA where Triton imports, torch
    elsewhere (the same bytes and scales)."""
    if x.is_cuda and x.shape[0] > 0:
        kernel = _triton_quant()
        if kernel is not None:
            return kernel(x)
    return per_token_quant_fp8_torch(x)


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale (one per-tensor scale) saturated to +-448, as float8_e4m3fn."""
    return (x.float() / _as_scale(scale, x.device)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


_TRITON_QUANT: list = []  # [the kernel's wrapper or None], once tried


def _triton_quant():
    if not _TRITON_QUANT:
        try:
            from engine.kernels.triton.fp8 import per_token_quant_fp8 as kernel
        except ImportError:
            kernel = None
        _TRITON_QUANT.append(kernel)
    return _TRITON_QUANT[0]


def _quantize_input(x2, input_scale):
    """-> (x float8 [M, K], fp32 scale: scalar for a static one, [M, 1] per token)."""
    if input_scale is None:
        return per_token_quant_fp8(x2)
    scale = _as_scale(input_scale, x2.device).reshape(())
    return static_quant_fp8(x2, scale), scale


def fp8_linear_reference(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor | float,
    input_scale: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 exactly, in fp32: x quantized (static or per token, in torch), both sides
    dequantized, multiplied in fp32, rounded to x's dtype once."""
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        xq, xs = per_token_quant_fp8_torch(x2)
    else:
        xs = _as_scale(input_scale, x.device).reshape(())
        xq = static_quant_fp8(x2, xs)
    y = (xq.float() * xs) @ dequantize_fp8(w_fp8, w_scale, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w_fp8.shape[0])


def _scaled_mm_ok(k: int, n: int) -> bool:
    return k % 16 == 0 and n % 16 == 0


def _scaled_mm(x2, w_fp8, w_scale, input_scale, out_dtype):
    """x2 [M, K] in a float dtype, w_fp8 [N, K] contiguous -> [M, N] in out_dtype."""
    n = w_fp8.shape[0]
    xq, xs = _quantize_input(x2, input_scale)
    ws = _as_scale(w_scale, x2.device)
    b = w_fp8.contiguous().t()  # [K, N], column-major: what _scaled_mm wants of its second operand
    if xs.numel() == 1 and ws.numel() == 1:
        return torch._scaled_mm(
            xq, b, scale_a=xs.reshape(()), scale_b=ws.reshape(()), out_dtype=out_dtype
        )
    scale_a = xs.reshape(-1, 1).expand(xq.shape[0], 1).contiguous()
    scale_b = ws.reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(xq, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor | float,
    input_scale: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T (+ bias), W = w_fp8 [N, K] (float8_e4m3fn, contiguous)
    times w_scale (per-tensor: a scalar; per-channel: [N]). input_scale: a static per-tensor
    activation scale, or None for dynamic per-token scales. W8A8 through _scaled_mm where
    the device has FP8 matmuls and the shape allows it, weight-only otherwise (module
    docstring). The output is in x's dtype. Scales given as Python floats become tensors on
    every call (a host-to-device copy on CUDA: not inside a captured graph); Fp8Linear
    holds them as device tensors."""
    n, k = w_fp8.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    x2 = x.reshape(-1, k)
    if supports_fp8_matmul(x.device) and _scaled_mm_ok(k, n) and x2.shape[0] > 0:
        y = _scaled_mm(x2.contiguous(), w_fp8, w_scale, input_scale, x.dtype)
        if bias is not None:
            y = y + bias
    else:
        y = torch.nn.functional.linear(x2, dequantize_fp8(w_fp8, w_scale, x.dtype), bias)
    return y.reshape(*x.shape[:-1], n)


@dataclass(slots=True)
class Fp8Linear:
    """One linear's fp8 weight, prepared once at load for the device's path: `fp8` (kept as
    float8 for _scaled_mm) or `dequantized` (the weight in the model's dtype: a GPU without
    FP8 matmuls, a CPU, or a shape _scaled_mm refuses)."""

    path: str
    weight: torch.Tensor  # float8 [N, K] or [N, K] in the model's dtype
    w_scale: torch.Tensor | None  # fp32, scalar or [N]; None once dequantized
    input_scale: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def prepare(
        cls,
        w_fp8: torch.Tensor,
        w_scale: torch.Tensor | float,
        input_scale: torch.Tensor | float | None = None,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Fp8Linear:
        device = w_fp8.device
        n, k = w_fp8.shape
        if supports_fp8_matmul(device) and _scaled_mm_ok(k, n):
            scale = _as_scale(w_scale, device)
            scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(n)
            static = None if input_scale is None else _as_scale(input_scale, device).reshape(())
            if static is None and scale.numel() == 1:  # per-token x: rowwise, one scale a column
                scale = scale.expand(n).contiguous()
            return cls("fp8", w_fp8.contiguous(), scale, static, bias)
        return cls("dequantized", dequantize_fp8(w_fp8, w_scale, dtype), None, None, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "dequantized":
            return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)
        return fp8_linear(x, self.weight, self.w_scale, self.input_scale, self.bias)
