"""NVFP4 checkpoints: compressed-tensors' `nvfp4-pack-quantized` (llm-compressor's NVFP4 and
NVFP4A16 schemes, the `...-NVFP4` / `...-FP4` uploads made for Blackwell).

A layer holds `weight_packed` uint8 [N, K / 2] (two e2m1 codes a byte, value 2j in the low
nibble, 2j + 1 in the high; a code is the sign bit, then an index into 0, 0.5, 1, 1.5, 2, 3,
4, 6), `weight_scale` float8_e4m3fn [N, K / 16] (one per 16 values, non-negative) and
`weight_global_scale` float32 [1]: W = value * (weight_scale / weight_global_scale), as the
package's dequantize computes it. W4A4 checkpoints add `input_global_scale` (the activations'
fp4 scheme): read and unused, activations stay in the model dtype (more exact).

After loading:
- CPU with the GGUF kernels, K (this rank's) a multiple of 64: the same codes and scale bytes
  repacked into ggml's NVFP4 blocks (to_gguf_nvfp4: 4.5 bits a weight, no float copy) on the
  GGUF dot kernels (engine/kernels/cpu/gguf.c: x as int8 per 32, integer dots per 16 values,
  each times its scale); 1 / weight_global_scale is applied per output row after the GEMM (a
  merged q|k|v or gate|up layer: each part's own).
- CUDA (and the tests' Triton interpreter): the checkpoint's codes and scale bytes as they are
  (0.5625 bytes a weight) on the NVFP4 Triton GEMM (engine/kernels/triton/nvfp4_gemm.py),
  weight-only, dequantized in its inner loop.
- Elsewhere (K not a multiple of 64, no kernels, no triton): dequantized at load into the model
  dtype (each value times its scale / global scale in float32, rounded once), served by the
  unquantized layers' GEMMs, at the float weight's bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.quantization.base import (
    LinearMethodBase,
    triton_linear,
    triton_weight,
    wants_triton,
)
from engine.layers.quantization.int_weight import register, register_bias
from engine.layers.quantization.mxfp4_blocks import FP4_VALUES
from engine.layers.quantization.packed import ScaleBytesLoader, ShardLoader, ignored_loader
from engine.layers.quantization.unquantized import linear_by_rows

GROUP = 16  # values a weight_scale covers
GGML_VALUES = 64  # ggml's NVFP4 superblock: 4 scale bytes, then 32 bytes of codes
GGML_BLOCK_BYTES = 36


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> the e2m1 codes uint8 [N, K], in weight order."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def dequantize_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """weight_packed uint8 [N, K / 2], weight_scale float8_e4m3fn [N, K / 16], the global
    scale float32 per row [N] -> W [N, K] in dtype: value * (scale / global scale) in float32,
    rounded once (compressed-tensors' dequantize)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[_codes(packed).long()]  # [N, K]
    s = scale.float() / global_scale.float().reshape(-1, 1)  # [N, K / 16]
    w = values.view(values.shape[0], -1, GROUP) * s.unsqueeze(-1)
    return w.reshape(values.shape).to(dtype)


def to_gguf_nvfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight_packed uint8 [N, K / 2] and weight_scale float8_e4m3fn [N, K / 16] (K % 64 == 0,
    every scale non-negative) -> ggml's NVFP4 rows uint8 [N, K / 64 * 36], the same bits: per
    64 values the 4 scale bytes (an e4m3 scale's bits are its ue4m3 byte), then per 16 values
    8 bytes, values 0-7 in the low nibbles and 8-15 in the high ones. The kernel reads each
    scale halved and each value doubled: the same products."""
    n, k = packed.shape[0], packed.shape[1] * 2
    codes = _codes(packed).view(n, k // GGML_VALUES, 4, GROUP)
    qs = (codes[..., :8] | (codes[..., 8:] << 4)).view(n, k // GGML_VALUES, 32)
    d = scale.view(torch.uint8).view(n, k // GGML_VALUES, 4)
    return torch.cat((d, qs), dim=-1).reshape(n, -1).contiguous()


def register_fp4(layer: nn.Module, k: int, n: int, group: int, scale_dtype: torch.dtype,
                 scheme: str) -> str:  # fmt: skip
    """An FP4 layer's checkpoint tensors (NVFP4's, MXFP4's): weight_packed uint8 [N, K / 2]
    and weight_scale [N, K / group] in scale_dtype; K (a TP shard's) must hold whole groups.
    Returns the layer's name for errors."""
    name = getattr(layer, "prefix", type(layer).__name__)
    if k % group:
        tp = getattr(layer, "tp_size", 1)
        raise ValueError(
            f"{name}: {scheme} scales cover groups of {group} inputs; this layer's "
            f"{'tensor-parallel shard has' if tp > 1 else 'input has'} {k} (of {k * tp}); "
            f"supported: a tensor_parallel_size whose shards are multiples of {group}"
        )
    register(layer, "weight_packed", torch.zeros(n, k // 2, dtype=torch.uint8),
             ShardLoader(layer, lambda t: t, name=name))  # fmt: skip
    register(layer, "weight_scale", torch.zeros(n, k // group, dtype=scale_dtype),
             ScaleBytesLoader(layer, name, scale_dtype, scheme))  # fmt: skip
    return name


class NvFp4LinearMethod(LinearMethodBase):
    """An NVFP4 checkpoint layer (module docstring). On the block path layer.weight is the
    ggml NVFP4 rows (uint8) and layer.row_scale float32 [N] (1 / global scale); on the Triton
    GEMM layer.weight is None and layer.nvfp4 the kernel's weight; on the dequantized path
    layer.weight is the float weight. triton: the Triton GEMM (None: on CUDA; True: also for
    CPU tensors, the tests' way under TRITON_INTERPRET=1)."""

    def __init__(self, triton: bool | None = None):
        self.triton = triton

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        name = register_fp4(layer, input_size, output_size, GROUP, torch.float8_e4m3fn, "NVFP4")
        n = output_size
        # one per checkpoint tensor: each merged part's, spread over its rows
        register(layer, "weight_global_scale", torch.ones(n, dtype=torch.float32),
                 ShardLoader(layer, lambda t: t.float().reshape(-1), input_dim=False, name=name))  # fmt: skip
        register(layer, "input_global_scale", torch.zeros(0), ignored_loader)  # W4A4: unused
        layer.input_global_scale.optional = True
        register_bias(layer, n, bias)

    @staticmethod
    def _block_refusal(packed: torch.Tensor, scale_bytes: torch.Tensor) -> str | None:
        """Why this layer cannot take the GGUF NVFP4 kernels (then it is dequantized)."""
        from engine.kernels.cpu import gguf as cpu_gguf

        k = packed.shape[1] * 2
        if packed.device.type != "cpu":
            return f"on {packed.device.type}: the GGUF kernels run on the CPU"
        if not cpu_gguf.available():
            return "the CPU kernels are not built"
        if k % GGML_VALUES:
            return f"K {k} is not a multiple of the kernels' {GGML_VALUES}"
        if bool(((scale_bytes & 0x80) != 0).logical_and(scale_bytes != 0x80).any()):
            return "negative weight_scale values (ggml's ue4m3 has no sign)"
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = getattr(layer, "model_dtype", torch.get_default_dtype())
        name = getattr(layer, "prefix", type(layer).__name__)
        packed, scale = layer.weight_packed.data, layer.weight_scale.data
        g = layer.weight_global_scale.data
        del layer.weight_packed, layer.weight_scale, layer.weight_global_scale
        del layer.input_global_scale
        if not bool(torch.isfinite(g).all() and (g > 0).all()):
            raise ValueError(f"{name}: weight_global_scale {g.unique().tolist()} (supported: "
                             "finite positive values)")  # fmt: skip
        scale_bytes = scale.view(torch.uint8)
        if bool(((scale_bytes & 0x7F) == 0x7F).any()):
            raise ValueError(f"{name}: weight_scale holds NaN (e4m3's 0x7F)")
        acts = "activations in the model dtype (a W4A4 checkpoint's input_global_scale unused)"
        layer.row_scale = None
        triton_why = ""
        if wants_triton(self.triton, packed.device):
            weight, triton_why = triton_weight("nvfp4_gemm", "NvFp4Weight",
                                               lambda cls: cls.prepare(packed, scale, g))  # fmt: skip
            if weight is not None:
                layer.register_parameter("weight", None)
                layer.nvfp4 = weight
                layer.quant_path = (
                    "NVFP4 codes and scale bytes (0.5625 bytes a weight) on the NVFP4 Triton "
                    "GEMM (engine/kernels/triton/nvfp4_gemm.py), dequantized in its inner loop; "
                    f"{acts}"
                )
                return
        why = self._block_refusal(packed, scale_bytes)
        if why is None:
            from engine.kernels.cpu import gguf as cpu_gguf

            layer.weight = nn.Parameter(to_gguf_nvfp4(packed, scale), requires_grad=False)
            layer.row_scale = (1.0 / g).contiguous()
            layer.gguf_type = cpu_gguf.TYPES["NVFP4"]
            layer.in_features = packed.shape[1] * 2
            layer.quant_path = (
                "NVFP4 as GGUF NVFP4 blocks (4.5 bits a weight) on the GGUF dot kernels, x as "
                f"int8 per 32, 1 / weight_global_scale per output row after the GEMM; {acts}"
            )
            return
        layer.weight = nn.Parameter(dequantize_nvfp4(packed, scale, g, dtype), requires_grad=False)
        layer.quant_path = (
            f"NVFP4 dequantized at load into {str(dtype).removeprefix('torch.')} ({why}{triton_why}; the "
            f"float weight's bytes, C GEMM / AMX-bf16 / oneDNN / cuBLAS); {acts}"
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.weight is None:  # the Triton GEMM (process_weights_after_loading)
            return triton_linear("nvfp4_gemm", "nvfp4_gemm", x, layer.nvfp4, bias)
        if layer.row_scale is None:
            return linear_by_rows(layer, x, layer.weight, bias)
        from engine.kernels.cpu import gguf as cpu_gguf

        y = cpu_gguf.linear(x, layer.weight, layer.gguf_type, layer.in_features)
        y = (y.float() * layer.row_scale).to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)
