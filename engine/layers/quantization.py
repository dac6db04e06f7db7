"""Weight-only int8 quantization for the CPU (`--quantization int8`).

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

`w8a8` keeps these weights and also quantizes the activations of batches above a few rows to
int8, one scale per row, for the CPU's int8 dot products: twice the GEMM throughput where
compute bounds a step, at a further cost in accuracy (engine.layers.cpu_w8a8 has both).

`w4a8` is w8a8 plus a second, 4-bit copy of each linear layer's weight (groups of 32 with a
scale and a minimum, engine.layers.cpu_w4) that steps of up to 12 rows read instead: 0.625
bytes a weight where one stream's decode is bound by reading them. The LM head stays int8.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import cpu_gemm, cpu_w4, cpu_w8a8

METHODS = ("int8", "w8a8", "w4a8")


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scale [N]) with weight ~ q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_model(model: nn.Module, method: str | None) -> int:
    """Quantize every linear layer and the LM head in place; returns how many were."""
    if method is None:
        return 0
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}; got {method!r}")
    from engine.layers.embedding import ParallelLMHead
    from engine.layers.linear import LinearBase

    weights = [m.weight for m in model.modules() if isinstance(m, LinearBase)]
    if any(w.device.type != "cpu" for w in weights):
        raise ValueError(
            f"--quantization {method} runs on the CPU GEMM kernel; use it with --device cpu"
        )
    dtype = weights[0].dtype if weights else torch.float32
    if not cpu_gemm.available(dtype, torch.int8):
        raise ValueError(
            f"--quantization {method} needs the compiled CPU kernels (a C compiler on the machine, "
            f"TESSERA_CPU_KERNELS not 0) and a bfloat16 or float32 model; got {dtype}"
        )
    if method == "w4a8" and not (dtype == torch.bfloat16 and cpu_w4.available()):
        raise ValueError(
            "--quantization w4a8 needs a bfloat16 model and a CPU with AVX512-VNNI (its 4-bit "
            "kernel); use w8a8 here"
        )
    count = 0
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            four_bit = method == "w4a8" and isinstance(module, LinearBase)
            if four_bit and module.weight.shape[1] % cpu_w4.K_MULTIPLE == 0:
                module.w4 = cpu_w4.quantize_groups(module.weight.data)
            module.quantize_int8()
            module.quantize_activations = method in ("w8a8", "w4a8")
            if module.quantize_activations:  # a second int8 copy, laid out for the GEMM
                int8 = module.qweight if isinstance(module, ParallelLMHead) else module.weight
                module.packed_int8 = cpu_w8a8.pack_weight(int8.data)
            count += 1
    return count
