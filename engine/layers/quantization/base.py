"""The linear-method interface: how a layer's weights are stored and multiplied.

A layer (engine.layers.linear's LinearBase, the LM head) holds one method, chosen at load
time for the weight format and the device (engine.layers.quantization.quantize_model);
forward calls `layer.quant_method.apply(layer, x, bias)`. Methods keep no state of their
own: what they make of the weights they register on the layer (vLLM's `quant_method`), so
one instance serves every layer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class LinearMethodBase:
    """y = x W^T (+ b) for a linear layer."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, bias: bool
    ) -> None:
        """Register the checkpoint's parameters on the layer: weight [out, in] and optionally
        bias [out], in the default dtype, each loaded by `layer.weight_loader`. Every method
        here quantizes after loading, so they all load the same full-precision weights."""
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        if bias:
            layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader
        else:
            layer.register_parameter("bias", None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded weights into this method's format (nothing to do by default)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., in] -> x W^T (+ bias) [..., out], in x's dtype."""
        raise NotImplementedError

    def apply_gated_mlp(
        self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor
    ) -> torch.Tensor | None:
        """down(silu(gate) * up) with [gate | up] = gate_up(x) in one fused call, asked of
        gate_up's method; None where this method has no such path for this call (then the
        layers run one by one)."""
        return None


class LMHeadMethodBase:
    """hidden [S, H] -> this rank's logits [S, vocab shard] for the LM head, whose rows are
    the (possibly tied) embedding's: the head creates no weights of its own."""

    def process_weights_after_loading(self, head: nn.Module) -> None:
        """Turn the loaded rows into this method's format (nothing to do by default)."""

    def apply(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def greedy(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax of apply(head, hidden) per row (the first maximum winning) without the
        logits in memory, as int64 [S]; None where this method has no such path for this call
        (then the caller computes the logits)."""
        return None


# -- the Triton GEMMs a quantized layer may run on (engine/kernels/triton) ---------------------


def wants_triton(triton: bool | None, device: torch.device) -> bool:
    """A method's `triton` setting: None takes the Triton GEMM on CUDA; True also for CPU
    tensors (the tests' way, under TRITON_INTERPRET=1)."""
    return triton if triton is not None else device.type == "cuda"


def triton_weight(
    kernel: str, weight_class: str, prepare: Callable[[type], Any]
) -> tuple[Any, str]:
    """(prepare(engine.kernels.triton.<kernel>.<weight_class>), "") — the kernel's form of a
    layer's weight — or (None, "; triton is unavailable (...)") for the start-up log. Triton is
    imported here, by the layers that run it only (CUDA, or a test under its interpreter)."""
    try:
        cls = getattr(importlib.import_module(f"engine.kernels.triton.{kernel}"), weight_class)
    except ImportError as e:
        return None, f"; triton is unavailable ({e})"
    return prepare(cls), ""


def triton_linear(kernel: str, gemm: str, x: torch.Tensor, weight: Any,
                  bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """x @ W^T (+ bias) on engine.kernels.triton.<kernel>.<gemm> for a triton_weight's W."""
    y = getattr(importlib.import_module(f"engine.kernels.triton.{kernel}"), gemm)(x, weight)
    return y if bias is None else y + bias.to(y.dtype)
