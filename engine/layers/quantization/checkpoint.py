"""Quantized checkpoints as people download them: config.json's `quantization_config` read,
its method picked with no flag (as vLLM does), and each linear layer given its format's
method before the weights load.

- `resolve_checkpoint(requested, qcfg)`: the method for `--quantization requested` on a
  checkpoint whose config.json has quantization_config qcfg (None: a float checkpoint). The
  checkpoint's own method wins; a flag that names it again is fine, one that contradicts it
  is a start-up ValueError naming both.
- `QuantizationConfig`: a checkpoint format's parsed and validated settings (one subclass per
  format: gptq.py, awq.py, compressed_tensors.py, fp8.py); `linear_method(prefix, sources)`
  gives one layer its method (None: the layer stays unquantized, e.g. an ignore list).
- `apply_checkpoint_methods(model, config)` (before the weights load: the layers hold the
  checkpoint's tensors, not a float weight) and `finish_checkpoint_methods(model, config)`
  (after: each layer's kernel form, and the start-up log of which kernel each layer kind runs).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.layers.quantization import CHECKPOINT_METHODS, checkpoint_config_class
from engine.layers.quantization.base import LinearMethodBase

if TYPE_CHECKING:
    from engine.layers.quantization.experts import ExpertsMethod

logger = logging.getLogger("tessera.engine")


def unsupported(field: str, value: Any, supported: str) -> ValueError:
    """The start-up error for a scheme Tessera does not run: the field, its value, the
    values it takes."""
    return ValueError(
        f"quantization_config.{field} = {value!r} is not supported; supported: {supported}"
    )


def kept_float(sources: list[str], skip: list[str], field: str) -> bool:
    """Whether the layer merged from `sources` stays float by the config's list of names to
    skip (`field`, named in the error where it keeps some of the merged parts and not others)."""
    skipped = [any(s in src for s in skip) for src in sources]
    if skip and all(skipped):
        return True
    if any(skipped):
        raise ValueError(
            f"quantization_config.{field} keeps some of {sources} in float and not the others: "
            "they run as one merged layer"
        )
    return False


class QuantizationConfig:
    """A checkpoint format's settings (subclasses: one per format)."""

    name = ""

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> QuantizationConfig:
        """Parse and validate config.json's quantization_config (ValueError naming the field)."""
        raise NotImplementedError

    @classmethod
    def online(cls) -> QuantizationConfig:
        """`--quantization NAME` on a float checkpoint: quantize at load, where the format can."""
        raise ValueError(
            f"--quantization {cls.name} needs a checkpoint quantized in that format (config.json "
            f"with quantization_config.quant_method {cls.name!r}); this model has none"
        )

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethodBase | None:
        """The method of the layer `prefix`, merged from the checkpoint's `sources` (q_proj,
        k_proj, v_proj; gate_proj, up_proj; else itself); None: it stays unquantized."""
        raise NotImplementedError

    def experts_method(self, prefix: str, sources: list[str]) -> ExpertsMethod | None:
        """The method of the MoE experts `prefix` (engine.layers.moe.FusedMoE), whose
        checkpoint tensors are `sources` (every expert's gate, up and down); None: they stay
        float. Formats without quantized experts refuse a checkpoint that quantizes them."""
        if self.linear_method(prefix, sources) is None:
            return None
        raise ValueError(
            f"{prefix}: this {self.name} checkpoint quantizes the MoE experts; Tessera runs "
            "quantized experts from compressed-tensors (float-quantized, pack-quantized), fp8, "
            "GPTQ and AWQ checkpoints only"
        )

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this format's layers register it (the loader asks
        before it places the tensor; bitsandbytes' dotted statistics get names of their own)."""
        return name

    def prepare_model(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Before loading, after the linear layers' methods: the format's other modules (the
        bitsandbytes routers' statistics); dtype: the model's."""

    def finish_model(self, model: nn.Module) -> None:
        """After loading, before the linear layers' kernel forms: prepare_model's modules."""

    def check_lm_head(self) -> None:
        """Raise where the checkpoint quantizes the LM head (Tessera keeps it in float)."""

    def describe(self) -> str:
        return self.name


def resolve_checkpoint(
    requested: str | None, qcfg: dict[str, Any] | None
) -> tuple[str | None, str] | None:
    """(method, why) where the checkpoint or the flag asks for a checkpoint format; None where
    neither does (resolve_method decides). Raises ValueError on a contradiction."""
    if qcfg is None:
        if requested in CHECKPOINT_METHODS:
            checkpoint_config_class(requested).online()  # raises where it cannot
            return requested, f"--quantization {requested}: weights quantized at load"
        return None
    method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors" or "config_groups" in qcfg:
        method = "compressed-tensors"
    if method not in CHECKPOINT_METHODS:
        raise unsupported("quant_method", qcfg.get("quant_method"), ", ".join(CHECKPOINT_METHODS))
    if requested not in (None, method):
        raise ValueError(
            f"--quantization {requested} contradicts the checkpoint: its config.json has "
            f"quantization_config.quant_method {method!r}, whose weights load only as "
            f"{method!r} (leave --quantization unset, or give {method})"
        )
    return method, f"the checkpoint's quantization_config (quant_method {method!r})"


def build_config(method: str, qcfg: dict[str, Any] | None) -> QuantizationConfig:
    cls = checkpoint_config_class(method)
    return cls.online() if qcfg is None else cls.from_checkpoint(qcfg)


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def apply_checkpoint_methods(model: nn.Module, config: QuantizationConfig) -> set[str]:
    """Before loading: every linear layer that the checkpoint quantizes gets its format's
    method and that method's parameters (the checkpoint's tensors) instead of its float
    weight. Returns no names (a load_model `prepare` hook: the loader fills them all)."""
    config.check_lm_head()
    model.quant_checkpoint_name = config.checkpoint_name
    merged: dict[str, list[str]] = {}
    for src, (dst, _) in getattr(model, "packed_modules_mapping", {}).items():
        merged.setdefault(dst, []).append(src)
    dtype = model.model.embed_tokens.weight.dtype
    for name, module in list(model.named_modules()):
        if not isinstance(getattr(module, "quant_method", None), LinearMethodBase):
            continue
        kind = _kind(name)
        sources = [f"{name[: -len(kind)]}{src}" for src in merged.get(kind, [kind])]
        method = config.linear_method(name, sources)
        if method is None:
            module.quant_path = "unquantized (not quantized in the checkpoint)"
            continue
        out_features, in_features = module.weight.shape
        device, bias = module.weight.device, module.bias is not None
        del module.weight
        del module.bias
        module.prefix, module.model_dtype = name, dtype
        module.quant_method = method
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                method.create_weights(module, in_features, out_features, bias)
        finally:
            torch.set_default_dtype(old)
        module.checkpoint_method = True
    _apply_experts_methods(model, config, dtype)
    config.prepare_model(model, dtype)
    return set()


def _apply_experts_methods(model: nn.Module, config: QuantizationConfig, dtype) -> None:
    """Every MoE layer whose experts the checkpoint quantizes gets the stacked parameters of
    that format (engine.layers.quantization.experts) instead of its float w13 / w2."""
    from engine.layers.moe import FusedMoE

    projections = list(getattr(model, "expert_projections", {}))
    ckpt_prefix = getattr(model, "moe_prefix", ".mlp.")
    for name, module in list(model.named_modules()):
        if not isinstance(module, FusedMoE):
            continue
        ckpt = name.replace(".mlp.", ckpt_prefix)
        sources = [f"{ckpt}.{e}.{p}" for e in range(module.num_experts) for p in projections]
        method = config.experts_method(name, sources)
        if method is None:
            continue
        module.prefix, module.model_dtype = name, dtype
        with torch.device(module.w13_weight.device):
            method.create_weights(module)
        module.experts_method = method


def finish_checkpoint_methods(model: nn.Module, config: QuantizationConfig) -> dict[str, Counter]:
    """After loading: each checkpoint layer's kernel form; returns {layer kind: Counter(path)}
    (the LM head's included), also logged."""
    from engine.layers.quantization.experts import ExpertProjection

    config.finish_model(model)
    paths: dict[str, Counter] = {}
    for module in list(model.modules()):
        method = getattr(module, "experts_method", None)
        if method is not None:
            module.experts_method = None
            paths.setdefault("experts", Counter())[
                method.process_weights_after_loading(module)
            ] += 1
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "quant_method", None), LinearMethodBase):
            continue
        if isinstance(module, ExpertProjection):  # counted with its experts above
            continue
        if getattr(module, "checkpoint_method", False):
            module.quant_method.process_weights_after_loading(module)
            module.checkpoint_method = False
        path = getattr(module, "quant_path", "unquantized")
        paths.setdefault(_kind(name), Counter())[path] += 1
    if getattr(model, "lm_head", None) is not None:
        paths["lm_head"] = Counter({"unquantized (the model's dtype)": 1})
    logger.info("Quantization %s: %s", config.name, config.describe())
    for kind, c in paths.items():
        logger.info(
            "  %s: %s", kind, ", ".join(f"{n} layers {why}" for why, n in sorted(c.items()))
        )
    return paths
