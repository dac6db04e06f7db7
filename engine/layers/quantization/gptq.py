"""GPTQ checkpoints (AutoGPTQ / GPTQModel: `quant_method: "gptq"`).

Per layer: `qweight` int32 [K / (32 / bits), N] (codes packed along K, lowest bits first),
`qzeros` int32 [G, N / (32 / bits)] (zero points packed along N), `scales` float16 [G, N], and
`g_idx` int32 [K] (each input row's group: act-order, `desc_act`). The classic format
(`checkpoint_format` "gptq", v1) stores each zero point minus 1; "gptq_v2" stores it as is.
2-, 3-, 4- and 8-bit, any group size (-1: one per output row), symmetric or not. W[k, n] =
(q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n] — the canonical form (packed.py) is this format's
own, so the CPU kernels take it as engine.layers.quantization.int_weight says.

3-bit codes are a bit stream (32 rows in 3 words, a code may straddle two). 2- and 3-bit
layers are served by the 4-bit kernels: each code and zero point is shifted up by
8 - 2**(bits-1), which keeps q - z (so the weight) exact and puts a symmetric layer's zero at
4-bit's 8; they then cost 4 bits a weight in memory, not 2 or 3.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.layers.quantization.checkpoint import QuantizationConfig, unsupported
from engine.layers.quantization.int_weight import IntWeightOnlyMethod
from engine.layers.quantization.packed import unpack_cols, unpack_rows

BITS = (2, 3, 4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, v2: bool):
        self.bits, self.group_size, self.desc_act, self.sym, self.v2 = (
            bits, group_size, desc_act, sym, v2,
        )  # fmt: skip

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> GPTQConfig:
        bits = qcfg.get("bits", 4)
        if bits not in BITS:
            raise unsupported("bits", bits, ", ".join(map(str, BITS)))
        group_size = qcfg.get("group_size", -1)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise unsupported("group_size", group_size, "-1 (per output row) or a positive size")
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in CHECKPOINT_FORMATS:
            raise unsupported("checkpoint_format", fmt, ", ".join(CHECKPOINT_FORMATS))
        if qcfg.get("lm_head", False):
            raise unsupported("lm_head", True, "false (the LM head unquantized)")
        if qcfg.get("dynamic"):
            raise unsupported("dynamic", qcfg["dynamic"], "none (one scheme for every layer)")
        return cls(bits, group_size, bool(qcfg.get("desc_act", False)),
                   bool(qcfg.get("sym", True)), fmt == "gptq_v2")  # fmt: skip

    def linear_method(self, prefix: str, sources: list[str]) -> GPTQLinearMethod:
        return GPTQLinearMethod(self.bits, self.group_size, self.sym, self.desc_act, self.v2)

    def experts_method(self, prefix: str, sources: list[str]):
        """MoE experts as engine.layers.quantization.experts takes them (desc_act: each
        expert's g_idx its own order)."""
        from engine.layers.quantization.experts import IntExpertsMethod

        return IntExpertsMethod(self.linear_method(prefix, sources))

    def describe(self) -> str:
        return (
            f"GPTQ {self.bits}-bit, group size {self.group_size}, "
            f"{'symmetric' if self.sym else 'asymmetric'}"
            f"{', act-order (desc_act)' if self.desc_act else ''}, "
            f"{'gptq_v2' if self.v2 else 'gptq (v1: zero points stored minus 1)'}"
            f"{'; served as 4-bit codes' if self.bits < 4 else ''}"
        )


class GPTQLinearMethod(IntWeightOnlyMethod):
    CODES, SCALES, ZEROS, G_IDX = "qweight", "scales", "qzeros", "g_idx"

    def __init__(self, bits: int, group_size: int, sym: bool, desc_act: bool, v2: bool = False):
        # the loaded layer holds 4-bit codes where the checkpoint's are narrower (docstring)
        super().__init__(max(bits, 4), group_size, sym, desc_act)
        self.checkpoint_bits, self.v2 = bits, v2
        self.shift = 8 - (1 << (bits - 1)) if bits < 4 else 0

    def convert_codes(self, t: torch.Tensor) -> torch.Tensor:
        return unpack_rows(t, self.checkpoint_bits).t() + self.shift

    def convert_scales(self, t: torch.Tensor) -> torch.Tensor:
        return t.float().t()

    def convert_zeros(self, t: torch.Tensor) -> torch.Tensor:
        z = unpack_cols(t, self.checkpoint_bits)
        return (z if self.v2 else z + 1).t() + self.shift  # v1 stores zero - 1
