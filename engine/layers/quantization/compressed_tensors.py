"""compressed-tensors checkpoints (llm-compressor's: `quant_method: "compressed-tensors"`).

quantization_config holds `config_groups` (each: `targets` — "Linear", a layer name, or
"re:<regex>" — and the `weights` / `input_activations` quantization args), a `format` (global
or per group) and an `ignore` list. Supported:
- `pack-quantized`: int4 or int8 weights (W4A16 / W8A16), group or channel strategy,
  symmetric or not, act-order's `weight_g_idx`: `weight_packed` int32 [N, K * bits / 32]
  (codes + 2**(bits - 1), packed along K, lowest bits first), `weight_scale` [N, G],
  `weight_zero_point` int32 [N * bits / 32, G] (packed along N) where asymmetric,
  `weight_shape`; dequant (q - z) * s. Converted into the canonical form (packed.py). 4-bit
  weights may come with int8 dynamic per-token activations (llm-compressor's W4A8): on the
  CPU's w4 tiles the kernel quantizes x as it does for every 4-bit layer (int16 per row with
  AVX512-VNNI, int8 per group of 32 with AVX2), elsewhere x stays in the model dtype.
- `int-quantized` / `naive-quantized`: int8 `weight` [N, K] with `weight_scale` (channel or
  tensor) and int8 activations (W8A8: dynamic per token, or static `input_scale`, served
  dynamic per token on the CPU's W8A8 kernel; MoE experts too: experts.IntExpertsMethod).
- `float-quantized`: FP8 e4m3 `weight` with per-tensor or per-channel `weight_scale`, static
  or dynamic activations (engine.layers.quantization.fp8's method); or `strategy: "block"`
  with `block_structure` [bn, bk] (llm-compressor's FP8_BLOCK, dynamic per-token-group
  activations: engine.layers.quantization.fp8_block's method).
- `nvfp4-pack-quantized`: NVFP4 (fp4 e2m1 `weight_packed`, an e4m3 `weight_scale` per 16
  values, `weight_global_scale`; strategy tensor_group, group_size 16), weight-only (NVFP4A16)
  or with the fp4 activation scheme (W4A4 NVFP4), served weight-only: activations stay in the
  model dtype (engine.layers.quantization.nvfp4). Its MoE experts are refused.
- `mxfp4-pack-quantized`: MXFP4 (fp4 e2m1 `weight_packed`, a uint8 E8M0 `weight_scale` per
  32 values; strategy group, group_size 32), weight-only (MXFP4A16) or with the MXFP4 scheme's
  fp4 activations, served weight-only (engine.layers.quantization.mxfp4_linear). Its MoE
  experts are refused.
Anything else (other formats, bit widths, strategies, activation schemes, a quantized LM head,
a KV-cache scheme) is a start-up error naming the field and the values Tessera takes.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from engine.layers.quantization.base import LinearMethodBase
from engine.layers.quantization.checkpoint import QuantizationConfig, unsupported
from engine.layers.quantization.fp8 import Fp8LinearMethod, check_block_size
from engine.layers.quantization.fp8_block import Fp8BlockLinearMethod
from engine.layers.quantization.int_weight import IntWeightOnlyMethod
from engine.layers.quantization.kv_scales import check_kv_cache_scheme
from engine.layers.quantization.mxfp4_linear import MxFp4LinearMethod
from engine.layers.quantization.nvfp4 import NvFp4LinearMethod
from engine.layers.quantization.packed import unpack_cols

if TYPE_CHECKING:
    from engine.layers.quantization.experts import ExpertsMethod

FORMATS = (
    "pack-quantized",
    "int-quantized",
    "naive-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
)


def _match(target: str, name: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith(f".{target}")


class _Scheme:
    """One config group, validated: (format, weight args, input args)."""

    def __init__(self, key: str, group: dict[str, Any], fmt: str):
        where = f"config_groups.{key}"
        self.targets = list(group.get("targets") or [])
        self.format = group.get("format") or fmt
        self.format_field = f"{where}.format" if group.get("format") else "format"
        if self.format not in FORMATS:
            raise unsupported(f"{where}.format" if group.get("format") else "format",
                              self.format, ", ".join(FORMATS))  # fmt: skip
        w = group.get("weights") or {}
        a = group.get("input_activations")
        self.bits = w.get("num_bits", 8)
        self.type = w.get("type", "int")
        self.symmetric = bool(w.get("symmetric", True))
        self.strategy = w.get("strategy", "tensor")
        self.group_size = w.get("group_size")
        self.actorder = w.get("actorder")
        self.act_quant = a is not None
        self.block: tuple[int, int] | None = None  # float-quantized's block_structure
        if w.get("dynamic", False):
            raise unsupported(f"{where}.weights.dynamic", w["dynamic"], "false")
        if self.format == "pack-quantized":
            if self.type != "int" or self.bits not in (4, 8):
                raise unsupported(f"{where}.weights.num_bits", self.bits,
                                  "4 or 8 (int) for pack-quantized")  # fmt: skip
            if self.strategy not in ("group", "channel"):
                raise unsupported(f"{where}.weights.strategy", self.strategy, "group, channel")
            if self.strategy == "group" and not (isinstance(self.group_size, int)
                                                 and self.group_size > 0):  # fmt: skip
                raise unsupported(f"{where}.weights.group_size", self.group_size, "a positive size")
            if a is not None:  # W4A8: int8 per-token activations, as the w4 kernel takes x
                if self.bits != 4:
                    raise unsupported(f"{where}.input_activations", a,
                                      "null (8-bit pack-quantized weights are weight-only)")  # fmt: skip
                self._check_activations(where, a, "int")
                if a.get("strategy", "tensor") != "token" or not a.get("dynamic", False):
                    raise unsupported(f"{where}.input_activations.strategy",
                                      a.get("strategy"), "token, dynamic (W4A8)")  # fmt: skip
        elif self.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
            kind = "NVFP4" if self.format.startswith("nvfp4") else "MXFP4"
            self._check_fp4(f"{where}.weights", w, kind)
            if a is not None:  # W4A4: served weight-only (activations in the model dtype)
                self._check_fp4(f"{where}.input_activations", a, kind)
        elif self.format in ("int-quantized", "naive-quantized"):
            if self.type != "int" or self.bits != 8:
                raise unsupported(f"{where}.weights.num_bits", self.bits, "8 (int)")
            if self.strategy not in ("channel", "tensor"):
                raise unsupported(f"{where}.weights.strategy", self.strategy, "channel, tensor")
            if not self.symmetric:
                raise unsupported(f"{where}.weights.symmetric", False, "true")
            self._check_activations(where, a, "int")
        else:  # float-quantized
            if self.type != "float" or self.bits != 8:
                raise unsupported(f"{where}.weights.num_bits", self.bits, "8 (float: FP8 e4m3)")
            if self.strategy not in ("channel", "tensor", "block"):
                raise unsupported(f"{where}.weights.strategy", self.strategy,
                                  "channel, tensor, block")  # fmt: skip
            if self.strategy == "block":
                self.block = check_block_size(w.get("block_structure"),
                                              f"{where}.weights.block_structure")  # fmt: skip
            self._check_activations(where, a, "float", self.strategy == "block")
        if self.actorder not in (None, "group", "weight", "static", "dynamic"):
            raise unsupported(f"{where}.weights.actorder", self.actorder, "null, group, weight")

    @staticmethod
    def _check_fp4(field: str, args: dict[str, Any], kind: str) -> None:
        """An FP4 scheme's quantization args (weights or input_activations): fp4 e2m1 in
        symmetric groups; NVFP4: of 16 with a global scale; MXFP4: of 32, each an E8M0 power of
        two (uint8 scales)."""
        strategy, group = ("tensor_group", 16) if kind == "NVFP4" else ("group", 32)
        for key, want, allowed in (("num_bits", 4, f"4 ({kind}: fp4 e2m1)"),
                                   ("type", "float", f"float ({kind}: fp4 e2m1)"),
                                   ("strategy", strategy, strategy),
                                   ("group_size", group, f"{group} ({kind}'s)"),
                                   ("symmetric", True, "true")):  # fmt: skip
            if args.get(key, want) != want:
                raise unsupported(f"{field}.{key}", args.get(key), allowed)
        if kind == "MXFP4" and args.get("scale_dtype") not in (None, "torch.uint8", "uint8"):
            raise unsupported(f"{field}.scale_dtype", args.get("scale_dtype"), "torch.uint8")

    @staticmethod
    def _check_activations(where: str, a: dict[str, Any] | None, kind: str,
                           groups: bool = False) -> None:  # fmt: skip
        """groups: dynamic per-token-group activations are accepted too (FP8_BLOCK's)."""
        if a is None:
            return
        if a.get("num_bits", 8) != 8 or a.get("type", kind) != kind:
            raise unsupported(f"{where}.input_activations.num_bits", a.get("num_bits"),
                              f"8 ({kind})")  # fmt: skip
        strategy = a.get("strategy", "tensor")
        allowed = ("token", "tensor", "group") if groups else ("token", "tensor")
        if strategy not in allowed:
            raise unsupported(f"{where}.input_activations.strategy", strategy, ", ".join(allowed))
        if strategy == "group" and not a.get("dynamic", False):
            raise unsupported(f"{where}.input_activations.dynamic", a.get("dynamic"),
                              "true (per-token-group activation scales are dynamic)")  # fmt: skip

    def key(self) -> tuple:
        return (self.format, self.bits, self.type, self.symmetric, self.strategy,
                self.group_size, self.actorder, self.act_quant, self.block)  # fmt: skip

    def method(self) -> LinearMethodBase:
        if self.format == "nvfp4-pack-quantized":
            return NvFp4LinearMethod()
        if self.format == "mxfp4-pack-quantized":
            return MxFp4LinearMethod(activations=self.act_quant)
        if self.format == "float-quantized" and self.block is not None:
            return Fp8BlockLinearMethod(self.block, "weight_scale", "weights.block_structure")
        if self.format == "float-quantized":
            return Fp8LinearMethod(checkpoint=True)
        group = self.group_size if self.strategy == "group" else -1
        if self.format == "pack-quantized":
            return CTPackedLinearMethod(self.bits, group, self.symmetric,
                                        act_order=self.actorder == "group")  # fmt: skip
        return CTInt8LinearMethod(8, -1, True, False, act_quant=self.act_quant)

    def describe(self) -> str:
        g = f" {self.group_size}" if self.strategy in ("group", "tensor_group") else ""
        g = f" {list(self.block)}" if self.block is not None else g
        w = f"{self.type}{self.bits} {self.strategy}{g} {'sym' if self.symmetric else 'asym'}"
        acts = ", activations quantized" if self.act_quant else ""
        if self.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized") and self.act_quant:
            acts = ", fp4 activations served in the model dtype"
        if self.format == "pack-quantized" and self.act_quant:  # W4A8
            acts = (
                ", int8 activations: on the CPU's w4 tiles as the kernel quantizes x (int16 "
                "per row with AVX512-VNNI, int8 per 32 with AVX2), else the model dtype"
            )
        return f"{self.format} ({w}{acts})"


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[_Scheme], ignore: list[str]):
        self.schemes, self.ignore = schemes, ignore

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = qcfg.get("format", "pack-quantized")
        groups = qcfg.get("config_groups") or {}
        if not groups:
            raise unsupported("config_groups", groups, "one or more quantization groups")
        check_kv_cache_scheme(qcfg.get("kv_cache_scheme"))  # its scales: kv_scales.py
        schemes = [_Scheme(k, g, fmt) for k, g in groups.items()]
        return cls(schemes, list(qcfg.get("ignore") or []))

    def scheme_for(self, name: str) -> _Scheme | None:
        if any(_match(t, name) for t in self.ignore):
            return None
        return next((s for s in self.schemes if any(_match(t, name) for t in s.targets)), None)

    def check_lm_head(self) -> None:
        if self.scheme_for("lm_head") is not None:
            raise unsupported("ignore", self.ignore,
                              "a list naming lm_head (the LM head unquantized)")  # fmt: skip

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethodBase | None:
        schemes = [self.scheme_for(s) for s in sources]
        if all(s is None for s in schemes):
            return None
        if any(s is None or s.key() != schemes[0].key() for s in schemes):
            raise ValueError(
                f"quantization_config gives {sources} different schemes (or ignores some): "
                "they run as one merged layer"
            )
        return schemes[0].method()

    def experts_method(self, prefix: str, sources: list[str]) -> ExpertsMethod | None:
        from engine.layers.quantization.experts import (
            Fp8BlockExpertsMethod,
            Fp8ExpertsMethod,
            IntExpertsMethod,
        )

        router = sources[0].rsplit(".experts.", 1)[0] + ".gate" if sources else ""
        if router and self.scheme_for(router) is not None:  # a ReplicatedGate: float only
            raise unsupported("ignore", self.ignore, f"a list naming the MoE routers ({router}: "
                              "Tessera keeps them in float, e.g. 're:.*mlp.gate$')")  # fmt: skip
        schemes = [self.scheme_for(s) for s in sources]
        if all(s is None for s in schemes):
            return None
        if any(s is None or s.key() != schemes[0].key() for s in schemes):
            raise ValueError(
                f"quantization_config gives the experts of {prefix} different schemes (or "
                "ignores some): they run as one stacked layer"
            )
        scheme = schemes[0]
        if scheme.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
            raise unsupported(scheme.format_field, scheme.format,
                              f"for MoE experts ({prefix}): pack-quantized, int-quantized, "
                              "naive-quantized, float-quantized; or list the experts in "
                              "ignore")  # fmt: skip
        if scheme.format == "float-quantized" and scheme.block is not None:
            return Fp8BlockExpertsMethod(scheme.block, "weight_scale", "weights.block_structure")
        if scheme.format == "float-quantized":
            return Fp8ExpertsMethod()
        # pack-quantized (act-order's weight_g_idx included) or int-quantized (W8A8): each
        # expert as a dense layer of the scheme
        return IntExpertsMethod(scheme.method())

    def describe(self) -> str:
        return "; ".join(s.describe() for s in self.schemes) + (
            f"; ignore {self.ignore}" if self.ignore else ""
        )


class CTPackedLinearMethod(IntWeightOnlyMethod):
    CODES, SCALES = "weight_packed", "weight_scale"
    EXTRA = ("weight_shape",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ZEROS = "" if self.symmetric else "weight_zero_point"
        self.G_IDX = "weight_g_idx" if self.act_order else ""

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        return unpack_cols(t, self.bits)  # stored unsigned (q + 2**(bits - 1)): the codes

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        return t.float()

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        offset = 1 << (self.bits - 1)
        if t.dtype == torch.int32:  # packed along N, stored with the offset
            return unpack_cols(t.t().contiguous(), self.bits).t()
        return t.to(torch.int32) + offset  # an unpacked signed zero point


class CTInt8LinearMethod(IntWeightOnlyMethod):
    CODES, SCALES = "weight", "weight_scale"
    EXTRA = ("input_scale", "input_zero_point", "weight_zero_point")

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        return (t.to(torch.int16) + 128).to(torch.uint8)

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().reshape(-1, 1)
