"""w8a8 plus a 4-bit copy of each linear layer's weight (`--quantization w4a8`).

Groups of 32 with a scale and a minimum (engine.kernels.cpu.w4) that calls of fewer rows than
w8a8's int8-activation threshold read instead of the int8 rows: 0.625 bytes a weight where
one stream's decode is bound by reading them. Layers whose input features are not a multiple
of cpu_w4.K_MULTIPLE keep only the int8 copies; the LM head stays w8a8.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.quantization.w8a8 import W8A8LinearMethod, int8_activations


class W4A8LinearMethod(W8A8LinearMethod):
    """W8A8LinearMethod's weights plus `layer.w4` (a cpu_w4.Q4Weight, or None)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        four_bit = layer.weight.shape[1] % cpu_w4.K_MULTIPLE == 0
        layer.w4 = cpu_w4.quantize_groups(layer.weight.data) if four_bit else None
        super().process_weights_after_loading(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.w4 is not None and not int8_activations(layer, x):
            y = cpu_w4.linear(x, layer.w4, bias)
            if y is not None:  # not a call the 4-bit kernel takes: the int8 rows
                return y
        return super().apply(layer, x, bias)
