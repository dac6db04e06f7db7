"""MXFP4 dense layers: compressed-tensors' `mxfp4-pack-quantized` (llm-compressor's MXFP4A16
and MXFP4 schemes).

A layer holds `weight_packed` uint8 [N, K / 2] (two e2m1 codes a byte, value 2j in the low
nibble: OpenAI's order, engine.layers.quantization.mxfp4_blocks) and `weight_scale` uint8
[N, K / 32], an E8M0 power of two (bias 127) per 32 values: W = value * 2 ** (scale - 127),
as the package's dequantize computes it. The MXFP4 (W4A4) scheme's fp4 activations are served
in the model dtype (more exact; logged).

After loading:
- CPU with the GGUF kernels: the same bits repacked into ggml's MXFP4 blocks
  (mxfp4_blocks.to_gguf_mxfp4: 4.25 bits a weight, no float copy) on the GGUF dot kernels
  (engine/kernels/cpu/gguf.c: x as int8 per 32, e2m1 values looked up as int8, one power of
  two per block), as a gpt-oss GGUF file's experts run.
- CUDA (and the tests' Triton interpreter): the checkpoint's codes and scale bytes as they are
  (0.53 bytes a weight) on the FP4 Triton GEMM (engine/kernels/triton/nvfp4_gemm.py, NVFP4's
  kernel with E8M0 scales per 32), weight-only, dequantized in its inner loop.
- Elsewhere (no CPU kernels, no triton): dequantized at load into the model dtype (exact: a
  power of two times an e2m1 value fits bf16), at the float weight's bytes, served by the
  unquantized layers' GEMMs.
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
from engine.layers.quantization.int_weight import register_bias
from engine.layers.quantization.mxfp4_blocks import dequantize_mxfp4, to_gguf_mxfp4
from engine.layers.quantization.nvfp4 import register_fp4
from engine.layers.quantization.unquantized import linear_by_rows

GROUP = 32  # values an E8M0 scale covers


def _blocks(packed: torch.Tensor) -> torch.Tensor:
    """weight_packed uint8 [N, K / 2] -> blocks [N, K / 32, 16] (mxfp4_blocks' layout)."""
    return packed.view(packed.shape[0], -1, GROUP // 2)


class MxFp4LinearMethod(LinearMethodBase):
    """An MXFP4 checkpoint layer (module docstring). On the block path layer.weight is the
    ggml MXFP4 rows (uint8) and layer.gguf_type their type; on the Triton GEMM layer.weight is
    None and layer.mxfp4 the kernel's weight; on the dequantized path layer.weight is the float
    weight and layer.gguf_type None. triton: the Triton GEMM (None: on CUDA; True: also for CPU
    tensors, the tests' way under TRITON_INTERPRET=1)."""

    def __init__(self, activations: bool = False, triton: bool | None = None):
        self.activations = activations  # the W4A4 scheme: its fp4 activations not applied
        self.triton = triton

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        register_fp4(layer, input_size, output_size, GROUP, torch.uint8, "MXFP4")
        register_bias(layer, output_size, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from engine.kernels.cpu import gguf as cpu_gguf

        dtype = getattr(layer, "model_dtype", torch.get_default_dtype())
        name = getattr(layer, "prefix", type(layer).__name__)
        packed, scale = layer.weight_packed.data, layer.weight_scale.data
        del layer.weight_packed, layer.weight_scale
        if bool((scale == 0xFF).any()):
            raise ValueError(f"{name}: weight_scale holds NaN (E8M0's 0xFF)")
        acts = (
            "; the scheme's fp4 activations served in the model dtype" if self.activations else ""
        )
        k = packed.shape[1] * 2
        triton_why = ""
        if wants_triton(self.triton, packed.device):
            weight, triton_why = triton_weight("nvfp4_gemm", "MxFp4Weight",
                                               lambda cls: cls.prepare(packed, scale))  # fmt: skip
            if weight is not None:
                layer.register_parameter("weight", None)
                layer.mxfp4 = weight
                layer.gguf_type = None
                layer.quant_path = (
                    "MXFP4 codes and E8M0 bytes (0.53 bytes a weight) on the FP4 Triton GEMM "
                    f"(engine/kernels/triton/nvfp4_gemm.py), dequantized in its inner loop{acts}"
                )
                return
        if packed.device.type != "cpu":
            why = f"on {packed.device.type}: the GGUF kernels run on the CPU{triton_why}"
        elif not cpu_gguf.available():
            why = "the CPU kernels are not built"
        else:
            why = cpu_gguf.refusal(cpu_gguf.TYPES["MXFP4"], k)
        if why is None:
            rows = to_gguf_mxfp4(_blocks(packed).unsqueeze(0), scale.unsqueeze(0))[0]
            layer.weight = nn.Parameter(rows, requires_grad=False)
            layer.gguf_type = cpu_gguf.TYPES["MXFP4"]
            layer.in_features = k
            layer.quant_path = (
                "MXFP4 as GGUF MXFP4 blocks (4.25 bits a weight) on the GGUF dot kernels, x as "
                f"int8 per 32{acts}"
            )
            return
        w = dequantize_mxfp4(_blocks(packed), scale, dtype)
        layer.weight = nn.Parameter(w, requires_grad=False)
        layer.gguf_type = None
        layer.quant_path = (
            f"MXFP4 dequantized at load into {str(dtype).removeprefix('torch.')} ({why}; the "
            f"float weight's bytes, C GEMM / AMX-bf16 / oneDNN / cuBLAS){acts}"
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.weight is None:  # the Triton GEMM (process_weights_after_loading)
            return triton_linear("nvfp4_gemm", "nvfp4_gemm", x, layer.mxfp4, bias)
        if layer.gguf_type is None:
            return linear_by_rows(layer, x, layer.weight, bias)
        from engine.kernels.cpu import gguf as cpu_gguf

        return cpu_gguf.linear(x, layer.weight, layer.gguf_type, layer.in_features, bias)
