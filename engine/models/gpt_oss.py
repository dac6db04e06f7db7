"""gpt-oss (OpenAI's open-weight MoE models, transformers' GptOssForCausalLM) on the Llama
decoder (engine.models.llama): what differs is

- attention: q/k/v/o biases, a learned sink per head in every softmax (PagedAttention's sinks,
  which every backend applies), sliding-window layers alternating with full ones
  (layer_types: the KV cache keeps every block, as for any hybrid model), yarn rope;
- the MLP: a router with a bias, top-k of its logits softmaxed over the k (= softmax, top-k,
  renormalized), experts with biases and the clamped SwiGLU (FusedMoE's "swigluoai").

Checkpoints store the experts stacked, gate_up_proj [E, H, 2I] with gate and up interleaved
(columns 0::2 and 1::2) and down_proj [E, I, H] (x @ W), or, as OpenAI publishes them, in
MXFP4 (quantization_config.quant_method "mxfp4": `*_blocks` / `*_scales` pairs, kept 4-bit on
CUDA (the fused Triton kernel reads the checkpoint's bytes) and on one CPU rank (GGUF MXFP4
blocks), else dequantized at load into the model's dtype: engine.layers.quantization.mxfp4
picks). Loading de-interleaves and transposes them into FusedMoE's w13 [E, 2I, H] (gate | up)
and w2 [E, H, I] (or their MXFP4 bytes in that order), this rank's experts and slice of I. A
llama.cpp gpt-oss GGUF (engine.gguf.convert) gives one tensor per expert and projection
instead (FusedMoE's own loader) and the gate and up biases apart ([E, I] each).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from engine.distributed import get_tp_rank
from engine.layers.moe import DOWN, GATE, UP, FusedMoE, ReplicatedGate, expert_weight_target
from engine.layers.quantization.mxfp4 import FusedMxfp4Experts, Mxfp4Experts, experts_kernel
from engine.layers.quantization.mxfp4_blocks import dequantize_mxfp4
from engine.models.hf_config import HFModelConfig
from engine.models.llama import LlamaForCausalLM


class GptOssMoE(nn.Module):
    """router (with a bias) -> experts (biases, clamped SwiGLU), every layer."""

    def __init__(self, cfg: HFModelConfig, mxfp4: bool):
        super().__init__()
        raw = cfg.raw
        self.router = ReplicatedGate(cfg.hidden_size, cfg.num_experts, bias=True)
        device = torch.get_default_device()
        # MXFP4: the float experts are not allocated (on a GPU, gpt-oss-120b's would not fit)
        # until the kernel is known; only their shapes are built here
        with torch.device("meta") if mxfp4 else nullcontext():
            self.experts = FusedMoE(
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                renormalize=True,
                bias=True,
                activation="swigluoai",
                swiglu=(float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0))),
            )
        experts = self.experts
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves awaiting a pair
        self._mxfp4: Mxfp4Experts | None = None  # GGUF MXFP4 blocks (one CPU rank)
        self._fused: FusedMxfp4Experts | None = None  # the checkpoint's bytes (the Triton kernel)
        if mxfp4:
            kernel, _ = experts_kernel(experts, device)
            names = ["w13_bias", "w2_bias"]
            if kernel == "triton":
                self._fused = FusedMxfp4Experts(experts, device)
            else:
                names += ["w13_weight", "w2_weight"]
                self._mxfp4 = Mxfp4Experts(experts) if kernel == "gguf" else None
            for name in names:
                meta = getattr(experts, name)
                setattr(experts, name, nn.Parameter(torch.empty_like(meta, device=device),
                                                    requires_grad=False))  # fmt: skip
            experts.w13_bias.data.zero_()
            experts.w2_bias.data.zero_()
        for param, proj in ((experts.w13_weight, "gate_up"), (experts.w2_weight, "down")):
            # FusedMoE's: a GGUF's tensors (none for the MXFP4 bytes)
            param.per_expert_shards = getattr(param, "expected_shards", None)
            param.weight_loader = self._load_weight
            param.expected_shards = {f"{proj}_blocks", f"{proj}_scales"} if mxfp4 else {proj}
        experts.w13_bias.weight_loader = self._load_gate_up_bias
        experts.w2_bias.weight_loader = self._load_down_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))

    # -- loading the checkpoint's stacked tensors ----------------------------------------

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard) -> None:
        if isinstance(shard, tuple):  # (expert, GATE/UP/DOWN): a GGUF file's one expert
            param.expected_shards = param.per_expert_shards  # the checkpoint's form
            self.experts.weight_loader(param, loaded, shard)
            return
        proj = shard
        if shard.endswith(("_blocks", "_scales")):
            proj, part = shard.rsplit("_", 1)
            pending = self._pending.setdefault(proj, {})
            pending[part] = loaded
            if len(pending) < 2:
                return  # the other half of the pair comes later
            del self._pending[proj]
            blocks, scales = pending["blocks"], pending["scales"]
            if self._fused is not None:  # this rank's experts and rows; down's K sliced there
                if proj == "gate_up":
                    e = self.experts
                    blocks = _gate_up_slice(self._mine(blocks), e.inter, e.slice_rank)
                    scales = _gate_up_slice(self._mine(scales), e.inter, e.slice_rank)
                else:
                    blocks, scales = self._mine(blocks), self._mine(scales)
                self._fused.load(proj, blocks, scales)
                return
            if self._mxfp4 is not None:  # rows in FusedMoE's order (gate | up), both at once
                if proj == "gate_up":
                    blocks, scales = (
                        _gate_up_slice(blocks, blocks.shape[1] // 2, 0),
                        _gate_up_slice(scales, scales.shape[1] // 2, 0),
                    )
                self._mxfp4.add(proj, blocks, scales)
                return
            # [E, rows, in] in the checkpoint's row order (gate_up: gate and up interleaved)
            loaded = dequantize_mxfp4(blocks, scales, param.dtype)
        else:  # x @ W layout: [E, in, rows]
            loaded = loaded.transpose(1, 2)
        self._fill(proj, loaded)

    def _fill(self, proj: str, w: torch.Tensor) -> None:
        """w [E, rows, in]: gate_up's rows interleaved."""
        if proj == "gate_up":
            self._fill_gate_up(self.experts.w13_weight, w)
        else:
            self._fill_down(self.experts.w2_weight, w)

    def _mine(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a stacked tensor [E, ...] (all of them without expert
        parallelism)."""
        e = self.experts
        return w[e.first_expert : e.first_expert + e.num_local_experts]

    def _fill_gate_up(self, param: nn.Parameter, w: torch.Tensor) -> None:
        """w [E, 2I, H], gate and up rows interleaved -> this rank's [E, 2i, H] (gate | up)."""
        e = self.experts
        self._copy(param, _gate_up_slice(self._mine(w), e.inter, e.slice_rank))

    def _fill_down(self, param: nn.Parameter, w: torch.Tensor) -> None:
        """w [E, H, I] -> this rank's columns [E, H, i]."""
        i, rank = self.experts.inter, self.experts.slice_rank
        self._copy(param, self._mine(w)[:, :, rank * i : (rank + 1) * i])

    def _load_gate_up_bias(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None
    ) -> None:
        e = self.experts
        i, rank = e.inter, e.slice_rank
        if shard is None:  # [E, 2I], gate and up interleaved
            self._copy(param, _gate_up_slice(self._mine(loaded), i, rank))
            return
        # a GGUF's gate or up biases [E, I] apart: this rank's slice into its half
        param.expected_shards = {"gate", "up"}
        half = param.data.narrow(1, 0 if shard == "gate" else i, i)
        self._copy(half, self._mine(loaded)[:, rank * i : (rank + 1) * i])

    def _load_down_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # an expert sliced over the ranks adds its bias on rank 0 only (the all-reduce over
        # the partial sums then holds it once); a whole expert (expert parallel) on its rank
        mine = self._mine(loaded)
        whole = self.experts.ep_size > 1 or get_tp_rank() == 0
        self._copy(param, mine if whole else torch.zeros_like(mine))

    @staticmethod
    def _copy(param: torch.Tensor, src: torch.Tensor) -> None:
        if param.shape != src.shape:
            raise ValueError(
                f"gpt-oss expert tensor shape mismatch: checkpoint gives {tuple(src.shape)} "
                f"for this rank, model {tuple(param.shape)}"
            )
        param.data.copy_(src)


def _gate_up_slice(w: torch.Tensor, i: int, rank: int) -> torch.Tensor:
    """[E, 2I, ...] with gate and up rows interleaved -> rank's [E, 2i, ...]: its gate rows,
    then its up rows."""
    rows = slice(rank * i, (rank + 1) * i)
    return torch.cat((w[:, 0::2][:, rows], w[:, 1::2][:, rows]), 1)


def gpt_oss_mlp(cfg: HFModelConfig, layer_idx: int) -> GptOssMoE:
    return GptOssMoE(cfg, (cfg.quantization_config or {}).get("quant_method") == "mxfp4")


class GptOssForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(gpt_oss_mlp)

    def __init__(self, cfg: HFModelConfig, max_position: int | None = None):
        if cfg.num_experts <= 0:
            raise ValueError(f"{cfg.architecture}: config.json names no experts")
        super().__init__(cfg, max_position)

    _EXPERT_TENSORS = {
        "gate_up_proj": ("w13_weight", "gate_up"),
        "gate_up_proj_blocks": ("w13_weight", "gate_up_blocks"),
        "gate_up_proj_scales": ("w13_weight", "gate_up_scales"),
        "gate_up_proj_bias": ("w13_bias", None),
        "down_proj": ("w2_weight", "down"),
        "down_proj_blocks": ("w2_weight", "down_blocks"),
        "down_proj_scales": ("w2_weight", "down_scales"),
        "down_proj_bias": ("w2_bias", None),
        "gate_proj_bias": ("w13_bias", "gate"),  # a GGUF's, [E, I] each
        "up_proj_bias": ("w13_bias", "up"),
    }
    # a GGUF's experts, one tensor per expert: model.layers.N.mlp.experts.E.gate_proj.weight
    _GGUF_PROJECTIONS = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """(our parameter, shard id) for the stacked expert tensors and the sinks; None for the
        rest (the loader's ordinary rules)."""
        prefix, _, last = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and last in self._EXPERT_TENSORS:
            param, shard = self._EXPERT_TENSORS[last]
            return f"{prefix}.{param}", shard
        per_expert = expert_weight_target(name, self._GGUF_PROJECTIONS)
        if per_expert is not None:
            return per_expert
        if name.endswith(".self_attn.sinks"):
            return name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), None
        return None
