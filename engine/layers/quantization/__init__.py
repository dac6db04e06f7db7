"""Linear methods: how each linear layer and the LM head store and multiply their weights.

One class per weight format, chosen once after loading for `--quantization` (vLLM's
`quant_method`): unquantized (the default: oneDNN or the C GEMM), int8 (weight-only), w8a8
(int8 activations too, from a few rows) and w4a8 (w8a8 plus 4-bit weights for small
batches); gguf serves a GGUF file's linear weights in the file's own quantization (its
module; the default for a .gguf model on the CPU, quantize.resolve_method). Every quantized
format runs on the CPU kernels; the per-format modules say why each exists and where it pays.

This module is the registry, and imports no method (nor torch) until one is chosen, so the
config and the CLI take their choices from it cheaply: a new format is one file here plus one
line in METHODS. quantize.py gives a loaded model its methods (quantize_model, resolve_method);
checkpoint.py reads a quantized checkpoint's quantization_config (GPTQ, AWQ, compressed-tensors,
FP8, bitsandbytes) and gives its layers their format's methods before the weights load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.layers.quantization.base import LinearMethodBase, LMHeadMethodBase

# --quantization -> ("module:class" of the linear layers' method, the LM head's), imported when
# chosen; w4a8's LM head stays int8. gguf's methods are per layer, from the file's block types
# (gguf.apply_gguf_blocks): it is per model, not per layer.
# A checkpoint's own format is "module:QuantizationConfig class" (engine.layers.quantization.
# checkpoint): picked from config.json's quantization_config with no flag; its layers get their
# methods before the weights load. fp8 also quantizes a float checkpoint at load.
METHODS: dict[str, tuple[str, str] | str | None] = {
    "int8": ("int8:Int8LinearMethod", "int8:Int8LMHeadMethod"),
    "w8a8": ("w8a8:W8A8LinearMethod", "w8a8:W8A8LMHeadMethod"),
    "w4a8": ("w4a8:W4A8LinearMethod", "w8a8:W8A8LMHeadMethod"),
    "gguf": None,
    "gptq": "gptq:GPTQConfig",
    "awq": "awq:AWQConfig",
    "compressed-tensors": "compressed_tensors:CompressedTensorsConfig",
    "fp8": "fp8:Fp8Config",
    "mxfp4": "mxfp4:Mxfp4Config",
    "bitsandbytes": "bnb:BitsAndBytesConfig",
}
# --quantization's values; unset picks the checkpoint's, gguf or none (quantize.resolve_method)
QUANTIZATION_CHOICES = ("none", *METHODS)
# the formats quantize_layer converts one layer to
LAYER_METHODS = tuple(name for name, classes in METHODS.items() if isinstance(classes, tuple))
# the checkpoint formats (config.json's quantization_config.quant_method)
CHECKPOINT_METHODS = tuple(name for name, spec in METHODS.items() if isinstance(spec, str))


def _load(spec: str) -> type:
    module, cls = spec.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def method_classes(name: str) -> tuple[type[LinearMethodBase], type[LMHeadMethodBase]]:
    """(the linear layers' method class, the LM head's) for a per-layer format of METHODS."""
    classes = METHODS.get(name)
    if not isinstance(classes, tuple):
        raise KeyError(f"{name!r} has no per-layer methods")
    linear, head = classes
    return _load(linear), _load(head)


def checkpoint_config_class(name: str) -> type:
    """The QuantizationConfig class of a checkpoint format of METHODS."""
    spec = METHODS.get(name)
    if not isinstance(spec, str):
        raise KeyError(f"{name!r} is not a checkpoint format")
    return _load(spec)
