"""AWQ checkpoints (AutoAWQ's GEMM layout: `quant_method: "awq"`, `version: "gemm"`).

Per layer: `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8], eight 4-bit values a word
along N in AWQ's interleaved order (bit field i holds column AWQ_ORDER[i] of its eight),
`scales` float16 [G, N]; zero points as they are (asymmetric). W[k, n] = (q[k, n] -
z[k // group, n]) * s[k // group, n]. Converted at load into the canonical GPTQ-style form
(packed.py): codes along K, zero points unpacked; the CPU kernels as int_weight.py says.
`modules_to_not_convert` layers stay unquantized.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.quantization.checkpoint import QuantizationConfig, unsupported
from engine.layers.quantization.int_weight import IntWeightOnlyMethod
from engine.layers.quantization.packed import unpack_cols

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, skip: list[str]):
        self.group_size, self.skip = group_size, skip

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> AWQConfig:
        bits = qcfg.get("bits", qcfg.get("w_bit", 4))
        if bits != 4:
            raise unsupported("bits", bits, "4")
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise unsupported("version", qcfg.get("version"), "gemm")
        if not qcfg.get("zero_point", True):
            raise unsupported("zero_point", qcfg.get("zero_point"), "true")
        group_size = qcfg.get("group_size", qcfg.get("q_group_size", 128))
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise unsupported("group_size", group_size, "-1 (per output row) or a positive size")
        return cls(group_size, list(qcfg.get("modules_to_not_convert") or []))

    def linear_method(self, prefix: str, sources: list[str]) -> AWQLinearMethod | None:
        skipped = [any(s in src for s in self.skip) for src in sources]
        if all(skipped):
            return None
        if any(skipped):
            raise ValueError(
                f"quantization_config.modules_to_not_convert keeps some of {sources} in float "
                "and not the others: they run as one merged layer"
            )
        return AWQLinearMethod(4, self.group_size, symmetric=False, act_order=False)

    def experts_method(self, prefix: str, sources: list[str]):
        method = self.linear_method(prefix, sources)
        if method is None:
            return None
        from engine.layers.quantization.experts import IntExpertsMethod

        return IntExpertsMethod(method)

    def describe(self) -> str:
        return f"AWQ 4-bit GEMM layout, group size {self.group_size}, zero points"


class AWQLinearMethod(IntWeightOnlyMethod):
    CODES, SCALES, ZEROS = "qweight", "scales", "qzeros"

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        return unpack_cols(t, 4, AWQ_ORDER).t()

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().t()

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        return unpack_cols(t, 4, AWQ_ORDER).t()
