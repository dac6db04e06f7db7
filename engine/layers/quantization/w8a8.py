"""int8 weights and, from a few rows, int8 activations (`--quantization w8a8`).

The weights are weight-only int8's rows (engine.layers.quantization.int8) plus a second copy
laid out for the packed int8 GEMM (`packed_int8`, cpu_w8a8.pack_weight). Calls of at least
`w8a8_min_rows` rows quantize x to int8, one scale per row, for the CPU's int8 dot products:
twice the GEMM throughput where compute bounds a step, at a further cost in accuracy
(engine.kernels.cpu.w8a8 has both). Fewer rows keep the weight-only kernel on the same int8
rows. Between the MLP's two GEMMs one C pass runs SiLU and the int8 rows of down_proj
(cpu_w8a8.mlp_w8a8); the LM head takes greedy tokens from its GEMM's argmax epilogue.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import w8a8 as cpu_w8a8
from engine.layers.quantization.int8 import Int8LinearMethod, Int8LMHeadMethod

# w8a8 layers quantize their activations from this many rows. Below it int8 weights alone
# are faster: oneDNN's _int_mm is slow at small M (the model's GEMMs on one Zen 5 core at
# 9 / 12 / 13 / 16 rows: 18.0 / 19.0 / 19.5 / 20.1 ms, the weight-only kernel 14.5 / 15.8 /
# 20.8 / 27.6) and the weight-only path is the more accurate one.
W8A8_MIN_ROWS = 13
# ... and from this many where the packed int8 GEMM runs on AMX tiles (cpu_w8a8): a w4a8
# decode step of 8 rows takes 12.2-12.9 ms there against 15.7-16.7 on the 4-bit kernel (an
# Intel Xeon with AMX, two cores); one row stays 2x faster on the 4-bit kernel.
AMX_W8A8_MIN_ROWS = 8


def w8a8_min_rows(layer: nn.Module, k: int) -> int:
    """The rows from which a w8a8 layer over k input features quantizes its activations (and
    a w4a8 layer leaves its 4-bit copy): AMX_W8A8_MIN_ROWS where its packed GEMM runs on AMX
    tiles, else W8A8_MIN_ROWS."""
    amx = layer.packed_int8 is not None and cpu_w8a8.amx_runs(k)
    return AMX_W8A8_MIN_ROWS if amx else W8A8_MIN_ROWS


def int8_activations(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether this call of a w8a8 layer quantizes x to int8 (from w8a8_min_rows rows)."""
    k = x.shape[-1]
    return x.numel() >= w8a8_min_rows(layer, k) * k


class W8A8LinearMethod(Int8LinearMethod):
    """Int8 rows, their packed copy (`layer.packed_int8`, None where the packed GEMM cannot
    take the shape: torch._int_mm then), int8 activations from w8a8_min_rows rows."""

    w8a8_min_rows = staticmethod(w8a8_min_rows)  # for callers holding only the method (decode plan)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.packed_int8 = cpu_w8a8.pack_weight(layer.weight.data)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if int8_activations(layer, x):
            return cpu_w8a8.linear_w8a8(
                x, layer.weight, bias, layer.weight_scale, None, layer.packed_int8
            )
        return super().apply(layer, x, bias)

    def apply_gated_mlp(
        self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor
    ) -> torch.Tensor | None:
        # at this many rows both GEMMs take int8 activations: one C pass between them
        if (
            int8_activations(gate_up, x)
            and isinstance(down.quant_method, W8A8LinearMethod)
            and down.tp_size == 1
        ):
            return cpu_w8a8.mlp_w8a8(x, gate_up, down)
        return None


class W8A8LMHeadMethod(Int8LMHeadMethod):
    """The LM head's int8 rows with their packed copy; from w8a8_min_rows rows, float32
    logits straight from the int32 sums (no bf16 rounding, no extra pass), and greedy
    tokens from the GEMM's argmax epilogue."""

    def process_weights_after_loading(self, head: nn.Module) -> None:
        super().process_weights_after_loading(head)
        head.packed_int8 = cpu_w8a8.pack_weight(head.qweight.data)

    def apply(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if int8_activations(head, hidden):
            return cpu_w8a8.linear_w8a8(
                hidden, head.qweight, None, head.weight_scale, torch.float32, head.packed_int8
            )
        return super().apply(head, hidden)

    def greedy(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        # only where apply would take the int8-activation path: the same float32 values
        if not int8_activations(head, hidden):
            return None
        return cpu_w8a8.argmax_w8a8(hidden, head.qweight, head.weight_scale, head.packed_int8)
