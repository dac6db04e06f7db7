"""KV-cache scales from quantized checkpoints (FP8-KV uploads, llm-compressor's kv_cache_scheme).

Such a checkpoint carries one K and one V scale per attention layer, calibrated so that
K / k_scale and V / v_scale fit e4m3's range (the fp8 cache stores x / scale, reads q * scale:
engine.attention.kv_fp8). They go to the layer's PagedAttention, whose backend reads them
with `--kv-cache-dtype fp8`; with any other cache they are read and unused (the cache holds
the model dtype's values, or the CPU's int8 rows with their own per-row scales), which the
start-up log says.

The names people's checkpoints use, all read:
- `<attn>.k_scale`, `<attn>.v_scale`: compressed-tensors / llm-compressor, vLLM's own;
- `<attn>.k_proj.output_scale`, `<attn>.v_proj.output_scale`: llm-compressor before 0.2;
- `<attn>.kv_scale`: AutoFP8, one scale for both;
- `<attn>.q_scale`, `<attn>.prob_scale`: fp8 attention's query and softmax scales, read and
  unused (Tessera's attention computes in the model dtype, which these would only round).
<attn> is the attention module's name in the checkpoint (`model.layers.N.self_attn`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.layer import PagedAttention
from engine.layers.quantization.checkpoint import unsupported

# checkpoint suffix -> which of the layer's scales it sets ("" : read and unused)
_SUFFIXES = {
    ".k_scale": "k",
    ".v_scale": "v",
    ".k_proj.output_scale": "k",
    ".v_proj.output_scale": "v",
    ".kv_scale": "kv",
    ".q_scale": "",
    ".prob_scale": "",
}
# the one kv_cache_scheme the fp8 cache serves: 8-bit float, one static scale per tensor
_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}


def check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """A checkpoint's kv_cache_scheme: None, or fp8 with static per-tensor scales (else a
    start-up error naming the field)."""
    if not scheme:
        return
    defaults = {"type": "int", "strategy": "tensor", "dynamic": False}  # the package's
    for field, want in _SCHEME.items():
        value = scheme.get(field, defaults.get(field))
        if value != want:
            raise unsupported(f"kv_cache_scheme.{field}", value, f"{want!r} (an fp8 KV cache "
                              "with one static scale per tensor)")  # fmt: skip
    if scheme.get("symmetric", True) is not True:
        raise unsupported("kv_cache_scheme.symmetric", scheme["symmetric"], "True")


def kv_scale_name(name: str) -> tuple[str, str] | None:
    """A checkpoint tensor's name -> (the attention module's name, which scale: k / v / kv /
    "" for read-and-unused), or None where it is no KV-cache scale."""
    for suffix, kind in _SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return None


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Set the scale a checkpoint tensor names on its layer's PagedAttention. False where the
    name is no KV-cache scale (the loader places it as any other weight)."""
    parsed = kv_scale_name(name)
    if parsed is None:
        return False
    module_name, kind = parsed
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False  # a weight of that name in another module (the loader decides)
    attn = next((m for m in module.modules() if isinstance(m, PagedAttention)), None)
    if attn is None:
        return False
    if not kind:
        return True
    if tensor.numel() != 1:
        raise ValueError(
            f"{name}: a KV-cache scale of shape {tuple(tensor.shape)}; Tessera's fp8 cache takes "
            "one scale per tensor (kv_cache_scheme.strategy 'tensor')"
        )
    value = float(tensor.float().reshape(-1)[0])
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} = {value}: a KV-cache scale must be positive and finite")
    if "k" in kind:
        attn.k_scale = value
    if "v" in kind:
        attn.v_scale = value
    attn.checkpoint_kv_scales = True
    return True
