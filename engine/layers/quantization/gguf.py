"""GGUF weights served in the file's own blocks (`--quantization gguf`).

Each linear layer whose GGUF tensors are of a type the CPU kernels read (Q4_0, Q4_1, Q8_0:
engine.layers.cpu_gguf) gets the file's bytes as its weight, so the weights in memory are
about the file's size and nothing is requantized: the loaded (dequantized) float weight is
dropped. Layers of other types (K-quants, mixed projections, float) keep today's dequantized
weights on the unquantized method; the log says which layer kinds took which path. The
embedding and the LM head stay dequantized (a gather, and the sampler's argmax paths).
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
        if b is None:
            why = skipped.get(name, "not in the file's block tensors")
        elif module.weight.device.type != "cpu":
            why = "runs on the CPU kernels only"
        elif getattr(module, "tp_size", 1) != 1:
            why = "tensor parallel shards keep the float weights"
        elif b.type_name not in cpu_gguf.TYPES:
            why = f"{b.type_name} has no kernel"
        elif tuple(module.weight.shape) != (b.data.shape[0], b.in_features):
            why = "shape differs from the model's"
        else:
            why = None
        kind = _kind(name)
        if why is not None:
            paths.setdefault(kind, Counter())[f"dequantized ({why})"] += 1
            continue
        module.weight = nn.Parameter(b.data, requires_grad=False)
        module.gguf_type, module.in_features = b.type_id, b.in_features
        module.quant_method = GGUFLinearMethod()
        paths.setdefault(kind, Counter())[f"{b.type_name} blocks"] += 1
    for kind, c in paths.items():
        logger.info(
            "GGUF %s: %s", kind, ", ".join(f"{n} layers {why}" for why, n in sorted(c.items()))
        )
    return paths
