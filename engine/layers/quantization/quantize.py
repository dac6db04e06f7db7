"""Giving a loaded model its linear methods: quantize_model for `--quantization` (every layer
converted by the registry's classes, engine.layers.quantization.METHODS, or a GGUF file's
blocks, gguf.apply_gguf_blocks), quantize_layer for one layer, and resolve_method, the
format an unset `--quantization` picks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import gguf as cpu_gguf
from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.quantization import LAYER_METHODS, method_classes
from engine.layers.quantization.base import LinearMethodBase, LMHeadMethodBase
from engine.layers.quantization.checkpoint import resolve_checkpoint
from engine.layers.quantization.gguf import apply_gguf_blocks


def _check_method(method: str) -> None:
    if method not in LAYER_METHODS:  # gguf is per model (quantize_model), not per layer
        raise ValueError(f"quantization must be one of {', '.join(LAYER_METHODS)}; got {method!r}")


def quantize_layer(layer: nn.Module, method: str) -> None:
    """Give one loaded layer (a linear layer or the LM head, told apart by the method it holds)
    the method for `--quantization method` and convert its weights to that method's format."""
    _check_method(method)
    linear_method, head_method = method_classes(method)
    current = getattr(layer, "quant_method", None)
    if isinstance(current, LMHeadMethodBase):
        layer.quant_method = head_method()
    elif isinstance(current, LinearMethodBase):
        layer.quant_method = linear_method()
    else:
        raise TypeError(f"{type(layer).__name__} holds no linear method")
    layer.quant_method.process_weights_after_loading(layer)


def _check_supported(method: str, weights: list[torch.Tensor]) -> None:
    """Every quantized format runs on the CPU kernels: refuse what they cannot take."""
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


def resolve_method(
    requested: str | None,
    gguf_path: str | Path | None,
    device: str | torch.device,
    load_format: str = "auto",
    tp_size: int = 1,
    checkpoint: dict | None = None,
) -> tuple[str | None, str]:
    """(the method quantize_model gets, None for the float weights; why) for `--quantization
    requested`: a quantized checkpoint (`checkpoint`, its config.json's quantization_config)
    loads in its own format, which a flag may name again but not contradict (ValueError);
    else given, as asked ("none": the float weights, a .gguf model dequantized);
    unset, gguf for a GGUF model (gguf_path, its file) served on the CPU kernels, where the
    file's own 4-bit weights are the fast path, else the float weights."""
    if checkpoint is not None and load_format == "dummy":
        raise ValueError(
            "--load-format dummy draws float weights; this checkpoint is quantized "
            f"(quantization_config.quant_method {checkpoint.get('quant_method')!r}): load it "
            "from its files"
        )
    picked = resolve_checkpoint(requested, checkpoint)
    if picked is not None:
        return picked
    if requested == "none":
        return None, "--quantization none: float weights"
    if requested is not None:
        return requested, f"--quantization {requested}"
    if gguf_path is None:
        return None, "not a GGUF model"
    if load_format == "dummy":
        return None, "dummy weights"
    if torch.device(device).type != "cpu":
        return None, f"GGUF blocks run on the CPU kernels only, not {torch.device(device).type}"
    if tp_size != 1:
        return None, "tensor parallel shards keep the float weights"
    if not cpu_gguf.available():
        return None, "no compiled CPU kernels (a C compiler, TESSERA_CPU_KERNELS not 0)"
    return "gguf", "a GGUF model on the CPU: the file's own quantization"


def quantize_model(
    model: nn.Module, method: str | None, gguf_path: str | Path | None = None
) -> int:
    """After loading: give every linear layer and the LM head the method for `--quantization
    method` (None or "none": they keep the unquantized one) and convert their weights;
    returns how many layers were quantized. "gguf" takes the blocks of gguf_path, the model's
    source."""
    if method in (None, "none"):
        return 0
    if method == "gguf":
        if gguf_path is None:
            raise ValueError("--quantization gguf needs a .gguf model (a file or the default)")
        return sum(
            n for c in apply_gguf_blocks(model, gguf_path).values()
            for why, n in c.items() if not why.startswith("dequantized")
        )  # fmt: skip
    _check_method(method)
    layers = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), (LinearMethodBase, LMHeadMethodBase))
    ]
    linears = [m.weight for m in layers if isinstance(m.quant_method, LinearMethodBase)]
    _check_supported(method, linears)
    for layer in layers:
        quantize_layer(layer, method)
    return len(layers)
