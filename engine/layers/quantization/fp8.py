"""FP8 weights: checkpoints in the `quant_method: "fp8"` layout (and compressed-tensors'
float-quantized, which shares this method), or `--quantization fp8` on a float checkpoint.

A checkpoint layer holds `weight` float8_e4m3fn [N, K], `weight_scale` float32 (one per
tensor, [] or [1], or one per output row, [N, 1]) and, with static activation scales,
`input_scale`: W = weight * weight_scale. With `weight_block_size` (block-wise scales,
`weight_scale_inv`) a layer takes engine.layers.quantization.fp8_block's method instead. On the
CPU the e4m3 bytes stay as they are, one byte a weight, on the CPU's FP8 kernels
(engine.kernels.cpu.fp8: the codes widened inside the kernel, the row scale on each sum; larger
batches on rows decoded to bf16 in cache). Where those do not take a layer (K not a multiple of
32, a float16 model, TESSERA_CPU_KERNELS=0) every e4m3 value is exact in the model dtype, so the
weight is kept as those exact values and the scale applied per output row after the GEMM (the
unquantized path's kernels: twice the bytes). Activations stay in the model dtype (input_scale
is read and unused: more accurate than the checkpoint's fp8 activations). `--quantization fp8`
on a float checkpoint computes one scale per output row at load (max |w| / 448) and rounds the
weight to e4m3: that rounding is its accuracy cost.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.kernels.cpu import fp8 as cpu_fp8
from engine.kernels.fp8 import Fp8Linear, supports_fp8_matmul
from engine.layers.quantization.base import LinearMethodBase
from engine.layers.quantization.checkpoint import QuantizationConfig, kept_float, unsupported
from engine.layers.quantization.fp8_block import (
    Fp8BlockLinearMethod,
    cpu_fp8_path,
    cpu_fp8_weight,
)
from engine.layers.quantization.int_weight import register, register_bias
from engine.layers.quantization.packed import ShardLoader, ignored_loader
from engine.layers.quantization.unquantized import linear_by_rows

FP8_MAX = 448.0  # float8_e4m3fn's largest value
ACTIVATION_SCHEMES = ("static", "dynamic")


def check_block_size(value, field: str) -> tuple[int, int]:
    """A config's [block_n, block_k]: two positive integers, else the start-up error naming
    field."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise unsupported(field, value, "two positive integers [block_n, block_k], e.g. [128, 128]")
    return int(value[0]), int(value[1])


def quantize_rows_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], float32 scale [N]) with w ~ q * scale[:, None]."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, checkpoint: bool, skip: list[str], activation_scheme: str = "dynamic",
                 block: tuple[int, int] | None = None):  # fmt: skip
        self.checkpoint, self.skip, self.activation_scheme = checkpoint, skip, activation_scheme
        self.block = block  # weight_block_size: block-wise scales (engine...fp8_block)

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> Fp8Config:
        scheme = qcfg.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise unsupported("activation_scheme", scheme, ", ".join(ACTIVATION_SCHEMES))
        if qcfg.get("fmt", "e4m3") != "e4m3":
            raise unsupported("fmt", qcfg["fmt"], "e4m3")
        block = qcfg.get("weight_block_size")
        if block is not None:
            block = check_block_size(block, "weight_block_size")
        skip = list(qcfg.get("ignored_layers") or qcfg.get("modules_to_not_convert") or [])
        return cls(True, skip, scheme, block)

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(False, [])

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethodBase | None:
        if kept_float(sources, self.skip, "ignored_layers"):
            return None
        if self.block is not None:
            return Fp8BlockLinearMethod(self.block, "weight_scale_inv", "weight_block_size")
        return Fp8LinearMethod(self.checkpoint, input_scale=self.activation_scheme == "static")

    def experts_method(self, prefix: str, sources: list[str]):
        """An fp8 checkpoint's experts stay FP8 (engine.layers.quantization.experts); at load
        (--quantization fp8 on a float checkpoint) they stay float."""
        if not self.checkpoint or self.linear_method(prefix, sources) is None:
            return None
        from engine.layers.quantization.experts import Fp8BlockExpertsMethod, Fp8ExpertsMethod

        if self.block is not None:
            return Fp8BlockExpertsMethod(self.block, "weight_scale_inv", "weight_block_size")
        return Fp8ExpertsMethod()

    def describe(self) -> str:
        if not self.checkpoint:
            return "FP8 e4m3 weights quantized at load, one scale per output row"
        scales = "per-tensor weight scales"
        if self.block is not None:
            scales = f"weight scales per block of {list(self.block)}"
        return f"FP8 e4m3 checkpoint, {scales}, {self.activation_scheme} activations"


class Fp8LinearMethod(LinearMethodBase):
    """layer.weight: the e4m3 values in the model dtype (exact); layer.weight_scale: float32
    [N], applied after the GEMM."""

    def __init__(self, checkpoint: bool, input_scale: bool = False):
        self.checkpoint, self.input_scale = checkpoint, input_scale

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool):
        if not self.checkpoint:  # a float checkpoint: quantized after loading
            return super().create_weights(layer, input_size, output_size, bias)
        name = getattr(layer, "prefix", "")
        n, k = output_size, input_size
        register(layer, "weight", torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                 ShardLoader(layer, lambda t: t, name=name))  # fmt: skip
        register(layer, "weight_scale", torch.zeros(n, dtype=torch.float32),
                 ShardLoader(layer, lambda t: t.float().reshape(-1), input_dim=False, name=name))  # fmt: skip
        # static activation scales: read, unused on the CPU (activations stay in the model dtype)
        register(layer, "input_scale", torch.zeros(0), ignored_loader)
        layer.input_scale.optional = True
        register_bias(layer, n, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = getattr(layer, "model_dtype", torch.get_default_dtype())
        if self.checkpoint:
            q, scale = layer.weight.data, layer.weight_scale.data
            del layer.input_scale
            why = "fp8 checkpoint"
        else:
            q, scale = quantize_rows_fp8(layer.weight.data)
            layer.weight_scale = None
            why = "quantized at load"
        del layer.weight, layer.weight_scale
        if supports_fp8_matmul(q.device):  # Ada / Hopper: float8 weights, _scaled_mm
            layer.fp8 = Fp8Linear.prepare(q, scale.float(), None, None, dtype)
            if layer.fp8.path == "fp8":
                layer.register_parameter("weight", None)
                layer.quant_path = (
                    f"float8 e4m3 through torch._scaled_mm, x quantized per token ({why})"
                )
                return
            del layer.fp8  # a shape _scaled_mm refuses: the model dtype's GEMM below
        cpu = cpu_fp8_weight(q, scale.float(), None, dtype)
        if cpu is not None:
            layer.register_parameter("weight", None)
            layer.fp8_cpu = cpu
            layer.quant_path = f"{cpu_fp8_path()} ({why})"
            return
        layer.weight = nn.Parameter(q.to(dtype).contiguous(), requires_grad=False)
        layer.weight_scale = scale.float().contiguous()
        layer.quant_path = (
            f"e4m3 values exact in {str(dtype).removeprefix('torch.')}, row scales after the "
            f"GEMM (C GEMM / AMX-bf16 / oneDNN; {why})"
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.weight is None and hasattr(layer, "fp8_cpu"):
            return cpu_fp8.linear(x, layer.fp8_cpu, bias)
        if layer.weight is None:  # float8 on the GPU (process_weights_after_loading)
            y = layer.fp8(x)
            return y if bias is None else y + bias.to(y.dtype)
        y = linear_by_rows(layer, x, layer.weight, None)
        y = (y.float() * layer.weight_scale).to(x.dtype)
        return y if bias is None else y + bias
