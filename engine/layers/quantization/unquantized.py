"""Unquantized weights (the default): oneDNN's F.linear, or the C GEMM (engine.layers.cpu_gemm)
for the batches where it is the faster of the two (`cpu_gemm.max_rows_for`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_gemm
from engine.layers.quantization.base import LinearMethodBase, LMHeadMethodBase


def linear_by_rows(
    layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T (+ bias) on the C GEMM up to the rows it is faster for, else F.linear.
    The row limit is decided once per layer, at its first call, on the loaded weight
    (`layer.cpu_gemm_max_rows`: tests set it)."""
    max_rows = getattr(layer, "cpu_gemm_max_rows", None)
    if max_rows is None:
        max_rows = layer.cpu_gemm_max_rows = cpu_gemm.max_rows_for(weight)
    if x.numel() <= max_rows * x.shape[-1]:
        return cpu_gemm.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class UnquantizedLinearMethod(LinearMethodBase):
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear_by_rows(layer, x, layer.weight, bias)


class UnquantizedLMHeadMethod(LMHeadMethodBase):
    def apply(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return linear_by_rows(head, hidden, head.weight, None)

    def greedy(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        if hidden.device.type == "cpu":
            return None  # the CPU sampler's blocked argmax over the float32 logits is faster
        # The argmax of the logits in the model's dtype: the float32 copy the head's forward
        # makes is exact, so the same ids (the first maximum wins), without that [S, V] copy.
        return linear_by_rows(head, hidden, head.weight, None).argmax(-1)
