"""Mixture-of-experts families on the Llama decoder (engine.models.llama): Mixtral, Qwen2-MoE
(a shared expert behind a sigmoid gate; qkv bias) and Qwen3-MoE (q/k norms). Only the MLP
differs: each layer's is a SparseMoeBlock (engine.layers.moe), or the dense gated MLP where the
config keeps a layer dense (mlp_only_layers, decoder_sparse_step).

Checkpoints keep one tensor per expert (Mixtral: block_sparse_moe.experts.E.w1/w2/w3 and
block_sparse_moe.gate; Qwen: mlp.experts.E.gate_proj/up_proj/down_proj and mlp.gate);
map_checkpoint_name sends each into the stacked w13 / w2 parameters with its (expert, shard).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.layers.moe import DOWN, GATE, UP, SparseMoeBlock, expert_weight_target
from engine.models.hf_config import HFModelConfig
from engine.models.llama import LlamaForCausalLM, LlamaMLP


def moe_mlp(cfg: HFModelConfig, layer_idx: int) -> nn.Module:
    if not cfg.is_moe_layer(layer_idx):
        return LlamaMLP(cfg)
    return SparseMoeBlock(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        renormalize=cfg.norm_topk_prob,
        scoring_func=cfg.moe_scoring_func,
        shared_intermediate_size=cfg.shared_expert_intermediate_size,
        shared_expert_gate=cfg.shared_expert_intermediate_size > 0,
    )


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose MLPs are mixtures of experts."""

    make_mlp = staticmethod(moe_mlp)
    expert_projections = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
    moe_prefix = ".mlp."  # the checkpoint's name of the MoE block

    def __init__(self, cfg: HFModelConfig, max_position: int | None = None):
        if cfg.num_experts <= 0:
            raise ValueError(f"{cfg.architecture}: config.json names no experts")
        super().__init__(cfg, max_position)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """(our parameter, shard id) for a checkpoint tensor the packed mapping cannot place,
        or None (the loader's ordinary rules then apply)."""
        if self.moe_prefix != ".mlp." and self.moe_prefix in name:
            name = name.replace(self.moe_prefix, ".mlp.")
            target = expert_weight_target(name, self.expert_projections)
            return target if target is not None else (name, None)
        return expert_weight_target(name, self.expert_projections)


class MixtralForCausalLM(MoeForCausalLM):
    expert_projections = {"w1": GATE, "w3": UP, "w2": DOWN}
    moe_prefix = ".block_sparse_moe."


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass
