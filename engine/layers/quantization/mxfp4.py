"""MXFP4 checkpoints (OpenAI's gpt-oss: quantization_config.quant_method "mxfp4").

Only the MoE experts are MXFP4 (the attention, router, embeddings and LM head stay bf16: the
config's modules_to_not_convert), each weight as a pair: `*_blocks` uint8 [..., G, 16] (two
FP4 e2m1 values a byte, the low nibble first) and `*_scales` uint8 [..., G] (an E8M0 power of
two per 32 values, bias 127; their decoding and GGUF repack: mxfp4_blocks). No linear layer
gets a quantized method; experts_kernel picks, per MoE layer, how its experts run:

- "triton" (CUDA, any tensor or expert parallelism): the checkpoint's bytes as they are,
  codes [E, N, K / 2] and scales [E, N, K / 32] (K contiguous; gate_up's rows de-interleaved
  into gate | up, this rank's experts and slice of I), on the fused Triton MoE kernel, which
  decodes them in its inner loop (FusedMxfp4Experts: 4.25 bits a weight);
- "gguf" (one CPU rank with the GGUF kernels): GGUF MXFP4 blocks, the same bits with the
  nibbles reordered (to_gguf_mxfp4: 4.25 bits a weight, an eighth of float32's bytes), each
  routed expert on the GGUF dot kernels (engine/kernels/cpu/gguf.c: twice each e2m1 value is
  an int8 in [-12, 12], x as int8 per 32, as Q8_0's dots);
- "dequantize" (elsewhere: CPU ranks under TP or EP): the model's dtype at load (exactly:
  every FP4 value times a power of two is a bf16 value), the float MoE paths at 4x the bytes.

TESSERA_MXFP4_KERNEL=triton|gguf|dequantize forces one (triton on CPU tensors: the tests,
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from torch import nn

from engine.layers.quantization.base import LinearMethodBase
from engine.layers.quantization.checkpoint import QuantizationConfig
from engine.layers.quantization.mxfp4_blocks import blocks_width, to_gguf_mxfp4

logger = logging.getLogger("tessera.engine")
KERNELS = ("triton", "gguf", "dequantize")


def experts_kernel(moe: nn.Module, device: torch.device) -> tuple[str, str]:
    """(kernel, why) for a FusedMoE's MXFP4 experts on device (one of KERNELS; see the module
    doc), logged once per choice."""
    forced = os.environ.get("TESSERA_MXFP4_KERNEL")
    if forced and forced not in KERNELS:
        raise ValueError(f"TESSERA_MXFP4_KERNEL={forced!r} is not one of {', '.join(KERNELS)}")
    kernel, why = forced, "TESSERA_MXFP4_KERNEL"
    if kernel is None:
        if device.type == "cuda" and _triton_available():
            kernel, why = "triton", "CUDA"
        elif device.type == "cpu" and Mxfp4Experts.fits(moe, device):
            kernel, why = "gguf", "one CPU rank"
        else:
            kernel, why = "dequantize", f"{device.type}, tp {moe.tp_size}, ep {moe.ep_size}"
    if kernel == "gguf" and not Mxfp4Experts.fits(moe, device):
        kernel, why = "dequantize", "the GGUF kernels take one CPU rank with the C kernels built"
    if kernel == "triton" and (moe.hidden_size % 32 or moe.inter % 2):
        # an odd shard of I would start down's slice inside a byte of two codes
        why = f"this rank's share of I ({moe.inter}) is odd or H ({moe.hidden_size}) % 32 != 0"
        kernel = "dequantize"
    _log_choice(kernel, why)
    return kernel, why


@functools.cache
def _triton_available() -> bool:
    if os.environ.get("TESSERA_GPU_FUSED") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _log_choice(kernel: str, why: str) -> None:  # once per process and choice, not per layer
    what = {
        "triton": "kept 4-bit (codes and E8M0 scales) on the fused Triton MoE kernel",
        "gguf": "kept 4-bit as GGUF MXFP4 blocks on the GGUF kernels",
        "dequantize": "dequantized at load into the model dtype (4x the MXFP4 bytes)",
    }[kernel]
    logger.info("MXFP4 experts %s (%s)", what, why)


class FusedMxfp4Experts:
    """A FusedMoE's MXFP4 experts for the fused Triton kernel: w13_weight uint8 [E, 2i, H / 2]
    and w13_weight_scale uint8 [E, 2i, H / 32], w2_weight uint8 [E, H, i / 2] and
    w2_weight_scale uint8 [E, H, g], this rank's experts and slice of I (i = moe.inter) in the
    checkpoint's own bytes (ExpertWeights' mxfp4 layout). A shard of down's I need not start on
    a group of 32: its scales are the groups it touches and the kernel reads input k's as
    (k + group_offset) // 32 (gpt-oss-120b's I = 2880 over 4 ranks: 720 each). Set as the
    layer's fused_quantized (it reads the parameters at each call, so moving the layer moves
    them)."""

    def __init__(self, moe: nn.Module, device: torch.device):
        self.moe = moe
        e, i, h = moe.num_local_experts, moe.inter, moe.hidden_size
        start = moe.slice_rank * i  # down's first input on this rank
        self.group_offset = start % 32
        self.down_groups = (start // 32, -(-(start + i) // 32))
        shapes = {
            "w13_weight": (e, 2 * i, h // 2),
            "w13_weight_scale": (e, 2 * i, h // 32),
            "w2_weight": (e, h, i // 2),
            "w2_weight_scale": (e, h, self.down_groups[1] - self.down_groups[0]),
        }
        for name, shape in shapes.items():
            param = nn.Parameter(torch.zeros(shape, dtype=torch.uint8, device=device),
                                 requires_grad=False)  # fmt: skip
            # the scales load with their codes (the codes' expected_shards name both)
            param.optional = name.endswith("_scale")
            setattr(moe, name, param)
        moe.fused_quantized = self

    def load(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """proj "gate_up": blocks [E, 2i, H / 32, 16] and scales [E, 2i, H / 32], this rank's
        rows (gate | up); "down": [E, H, I / 32, 16] and [E, H, I / 32], every input of I
        (this rank's slice taken here)."""
        moe = self.moe
        e, rows = blocks.shape[:2]
        codes = blocks.reshape(e, rows, -1)  # [E, N, K / 2]: byte j holds inputs 2j, 2j + 1
        side = "w13" if proj == "gate_up" else "w2"
        if side == "w2":
            i, start = moe.inter, moe.slice_rank * moe.inter
            codes = codes[:, :, start // 2 : (start + i) // 2]
            scales = scales[:, :, self.down_groups[0] : self.down_groups[1]]
        for name, src in ((f"{side}_weight", codes), (f"{side}_weight_scale", scales)):
            dst = getattr(moe, name)
            if dst.shape != src.shape:
                raise ValueError(
                    f"MXFP4 experts: the checkpoint's {proj} gives {tuple(src.shape)} for this "
                    f"rank's {name}, the layer holds {tuple(dst.shape)}"
                )
            dst.data.copy_(src)

    def __call__(self, x, topk_weights, topk_ids, lora=None) -> torch.Tensor:
        from engine.kernels.triton.fused_moe import ExpertWeights, fused_experts_quantized

        moe = self.moe
        w13 = ExpertWeights(moe.w13_weight, moe.w13_weight_scale, bits=4, group=32, mxfp4=True)
        w2 = ExpertWeights(moe.w2_weight, moe.w2_weight_scale, bits=4, group=32, mxfp4=True,
                           group_offset=self.group_offset)  # fmt: skip
        biases = None if moe.w13_bias is None else (moe.w13_bias, moe.w2_bias)
        return fused_experts_quantized(x, w13, w2, topk_weights, topk_ids, biases,
                                       moe.activation, moe.swiglu, lora)  # fmt: skip


class Mxfp4Experts:
    """A MoE layer's MXFP4 experts as GGUF MXFP4 blocks (see the module doc), where they can be
    (fits): one CPU rank (no tensor or expert parallel slices), the GGUF kernels built and
    taking the layer's widths. add() collects both projections' MXFP4 pairs, then installs both
    as blocks (the layer's expert_linear runs them)."""

    def __init__(self, moe: nn.Module):
        from engine.kernels.cpu import gguf as cpu_gguf

        self.moe = moe
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.type_id = cpu_gguf.TYPES["MXFP4"]

    @staticmethod
    def fits(moe: nn.Module, device: torch.device) -> bool:
        from engine.kernels.cpu import gguf as cpu_gguf

        if device.type != "cpu" or moe.tp_size != 1 or moe.ep_size != 1:
            return False
        if not cpu_gguf.available():
            return False
        type_id = cpu_gguf.TYPES["MXFP4"]
        widths = (moe.hidden_size, moe.inter)  # the two GEMMs' in_features
        return all(cpu_gguf.refusal(type_id, k) is None for k in widths)

    def add(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """proj "gate_up" (rows gate | up) or "down"; once both are in, both are installed."""
        self.parts[proj] = (blocks, scales)
        if len(self.parts) < 2:
            return
        parts, self.parts = self.parts, {}
        q13, q2 = to_gguf_mxfp4(*parts["gate_up"]), to_gguf_mxfp4(*parts["down"])
        from types import SimpleNamespace

        from engine.layers.quantization.gguf import GGUFExperts

        moe = self.moe
        moe.w13_weight = nn.Parameter(q13, requires_grad=False)
        moe.w2_weight = nn.Parameter(q2, requires_grad=False)
        moe.expert_linear = GGUFExperts(
            SimpleNamespace(
                w13=q13, w2=q2, w13_type_id=self.type_id, w2_type_id=self.type_id,
                hidden_size=blocks_width(parts["gate_up"][0]),
                intermediate_size=blocks_width(parts["down"][0]),
            )
        )  # fmt: skip


class Mxfp4Config(QuantizationConfig):
    name = "mxfp4"

    def __init__(self, skip: list[str]):
        self.skip = skip

    @classmethod
    def from_checkpoint(cls, qcfg: dict[str, Any]) -> Mxfp4Config:
        return cls(list(qcfg.get("modules_to_not_convert") or []))

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethodBase | None:
        return None  # MXFP4 holds experts only (engine.models.gpt_oss loads them)

    def describe(self) -> str:
        return (
            "MXFP4 experts kept 4-bit (on CUDA the fused Triton MoE kernel, on one CPU rank "
            "GGUF MXFP4 blocks), else dequantized at load to the model's dtype; other layers "
            "as stored"
        )
