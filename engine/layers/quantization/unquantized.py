"""Unquantized weights (the default): the C GEMM (engine.kernels.cpu.gemm) up to the rows it is
the fastest for (`cpu_gemm.max_rows_for`), above them AMX-bf16 tiles on the same weight where
the CPU has them (engine.kernels.cpu.amx_bf16: no second copy) up to prefill sizes, else oneDNN's
F.linear. The rows are the instruction set's (engine.kernels.cpu.isa)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import isa as cpu_isa
from engine.layers.quantization.base import LinearMethodBase, LMHeadMethodBase


def _amx_for(weight: torch.Tensor) -> bool:
    """Whether calls above the C GEMM's rows run on AMX tiles: bf16 weights on a CPU with AMX,
    the C GEMM's policy auto (TESSERA_CPU_GEMM=0 or 1 keep today's choice)."""
    return (
        os.environ.get("TESSERA_CPU_GEMM", "auto") == "auto"
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and cpu_amx.available()
    )


def _path(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which GEMM takes this call: "gemm" (the C GEMM, up to the rows it is faster for),
    "amx" (AMX tiles above them, up to the plan's rows) or "torch" (F.linear). Both limits
    are decided once per layer, at its first call, on the loaded weight
    (`layer.cpu_gemm_max_rows`, `layer.cpu_amx`: tests set them)."""
    max_rows = getattr(layer, "cpu_gemm_max_rows", None)
    if max_rows is None:
        max_rows = layer.cpu_gemm_max_rows = cpu_gemm.max_rows_for(weight)
    if x.numel() <= max_rows * x.shape[-1]:
        return "gemm"
    amx = getattr(layer, "cpu_amx", None)
    if amx is None:
        amx = layer.cpu_amx = _amx_for(weight)
    return "amx" if amx and cpu_isa.plan().amx_rows(x.numel() // x.shape[-1]) else "torch"


def linear_by_rows(
    layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T (+ bias) on the GEMM _path picks (F.linear where AMX declines the call)."""
    path = _path(layer, x, weight)
    if path == "gemm":
        return cpu_gemm.linear(x, weight, bias)
    if path == "amx":
        y = cpu_amx.linear(x, weight, bias)
        if y is not None:
            return y
    return F.linear(x, weight, bias)


def greedy_by_rows(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """argmax(linear_by_rows(layer, x, weight, None).float()) per row where that call would
    run on AMX tiles: the tiles' argmax epilogue on the same bf16-rounded sums, without the
    [rows, vocab] logits written, widened and read again; None elsewhere (the sampler takes
    the logits)."""
    return cpu_amx.linear_argmax(x, weight) if _path(layer, x, weight) == "amx" else None


class UnquantizedLinearMethod(LinearMethodBase):
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear_by_rows(layer, x, layer.weight, bias)


class UnquantizedLMHeadMethod(LMHeadMethodBase):
    def apply(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return linear_by_rows(head, hidden, head.weight, None)

    def greedy(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        if hidden.device.type == "cpu":  # AMX's argmax epilogue, else the sampler's argmax
            return greedy_by_rows(head, hidden, head.weight)
        # The argmax of the logits in the model's dtype: the float32 copy the head's forward
        # makes is exact, so the same ids (the first maximum wins), without that [S, V] copy.
        return linear_by_rows(head, hidden, head.weight, None).argmax(-1)
