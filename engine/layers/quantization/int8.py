"""Weight-only int8 for the CPU (`--quantization int8`).

Decode at small batches reads every weight once per step, so its speed is memory bandwidth
over weight bytes: int8 halves bf16's bytes. Each output row n of a linear layer keeps
int8 values q[n] and one float32 scale s[n] = max|w[n]| / 127, so w[n] ~ q[n] * s[n]
(symmetric, per row: the error per weight is at most s[n] / 2). The CPU GEMM kernel widens
q to float32 in registers, accumulates in float32 and applies s[n] once per output; the
activations stay in the model dtype (on CPUs with AVX512-VNNI, a call of one or two rows
multiplies them as int16 with one scale per row instead: see cpu_gemm's `rows_i16`). The LM
head is quantized too (its own copy when it is tied: the embedding lookup keeps the original
rows).

This is not lossless like the default path: outputs can differ from the unquantized model's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import gemm as cpu_gemm
from engine.layers.quantization.base import LinearMethodBase, LMHeadMethodBase


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scale [N]) with weight ~ q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8LinearMethod(LinearMethodBase):
    """`layer.weight` becomes int8 rows, `layer.weight_scale` their float32 scales."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, layer.weight_scale = quantize_rows_int8(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cpu_gemm.linear(x, layer.weight, bias, layer.weight_scale)


class Int8LMHeadMethod(LMHeadMethodBase):
    """The int8 rows go to `head.qweight` (scales: `head.weight_scale`); the full-precision
    rows are dropped unless the embedding shares them (tied), whose lookup still reads them."""

    def process_weights_after_loading(self, head: nn.Module) -> None:
        head.qweight, head.weight_scale = quantize_rows_int8(head.weight.data)
        if not head.tied:  # nothing else reads the full-precision rows
            head.weight = nn.Parameter(head.weight.data.new_empty(0), requires_grad=False)

    def apply(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(hidden, head.qweight, None, head.weight_scale)
