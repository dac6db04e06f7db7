"""GGUF weights served in the file's own blocks (`--quantization gguf`).

Each linear layer whose GGUF tensors are of a type the CPU kernels read (Q4_0, Q4_1, Q8_0,
and the K-quants Q4_K, Q5_K, Q6_K where K % 256 == 0: engine.layers.cpu_gguf) gets the file's
bytes as its weight, so the weights in memory are about the file's size and nothing is
requantized: the loaded (dequantized) float weight is dropped. A merged projection whose
parts the file stores in different types (Q4_K_M: q/k Q4_K, v Q6_K) holds them as row
segments of their own types, one kernel call per segment (GGUFSegmentsLinearMethod). Layers
of other types (float parts, types without a kernel, K the blocks do not divide) keep
today's dequantized weights on the unquantized method; the log says which layer kinds took
which path. The embedding and the LM head stay dequantized (a gather, and the sampler's
argmax paths).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from engine.layers import cpu_gguf
from engine.layers.quantization.base import LinearMethodBase

logger = logging.getLogger("tessera.engine")


class GGUFLinearMethod(LinearMethodBase):
    """layer.weight: uint8 [out, row bytes] file blocks; layer.gguf_type (ggml id) and
    layer.in_features tell the kernel how to read them."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cpu_gguf.linear(x, layer.weight, layer.gguf_type, layer.in_features, bias)


class GGUFSegmentsLinearMethod(LinearMethodBase):
    """A merged projection of parts in different types: layer.weight is uint8, every byte of
    the segments (1-D, the only copy); layer.gguf_segments ((ggml id, uint8 [rows, row bytes])
    views of it, in row order) and layer.in_features tell the kernel how to read them."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return cpu_gguf.linear_segments(x, layer.gguf_segments, layer.in_features, bias)


def _refusal(module: nn.Module, b) -> str | None:
    """Why this layer keeps its dequantized weights, or None."""
    if module.weight.device.type != "cpu":
        return "runs on the CPU kernels only"
    if getattr(module, "tp_size", 1) != 1:
        return "tensor parallel shards keep the float weights"
    for s in b.segments:
        if s.type_name not in cpu_gguf.TYPES:
            return f"{s.type_name} has no kernel"
        why = cpu_gguf.refusal(s.type_id, b.in_features)
        if why is not None:
            return f"{s.type_name}: {why}"
    if tuple(module.weight.shape) != (b.out_features, b.in_features):
        return "shape differs from the model's"
    return None


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]  # "model.layers.3.mlp.down_proj" -> "down_proj"


def apply_gguf_blocks(model: nn.Module, gguf_path: str | Path) -> dict[str, Counter]:
    """Give every linear layer whose file type has a kernel the file's blocks and
    GGUFLinearMethod; returns {layer kind: Counter(path taken)} (also logged)."""
    from engine.models.gguf_blocks import read_linear_blocks

    if not cpu_gguf.available():
        raise ValueError(
            "--quantization gguf needs the compiled CPU kernels (a C compiler on the machine, "
            "TESSERA_CPU_KERNELS not 0)"
        )
    attn = model.model.layers[0].self_attn
    blocks, skipped = read_linear_blocks(gguf_path, attn.num_heads, attn.num_kv_heads)
    modules = dict(model.named_modules())
    paths: dict[str, Counter] = {}
    for name, module in modules.items():
        if not isinstance(getattr(module, "quant_method", None), LinearMethodBase):
            continue
        b = blocks.get(name)
        why = (
            skipped.get(name, "not in the file's block tensors")
            if b is None
            else _refusal(module, b)
        )
        kind = _kind(name)
        if why is not None:
            paths.setdefault(kind, Counter())[f"dequantized ({why})"] += 1
            continue
        module.weight = nn.Parameter(b.data, requires_grad=False)
        module.in_features = b.in_features
        if len(b.segments) == 1:
            module.gguf_type = b.type_id
            module.quant_method = GGUFLinearMethod()
        else:
            module.gguf_segments = tuple((s.type_id, s.data) for s in b.segments)
            module.quant_method = GGUFSegmentsLinearMethod()
        paths.setdefault(kind, Counter())[f"{b.type_name} blocks"] += 1
    for kind, c in paths.items():
        logger.info(
            "GGUF %s: %s", kind, ", ".join(f"{n} layers {why}" for why, n in sorted(c.items()))
        )
    return paths
