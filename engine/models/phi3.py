"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder (engine.models.llama) with the
checkpoint's fused projections, LongRoPE and partial rotary.

The checkpoint keeps q, k and v in one qkv_proj tensor ([q; k; v] rows) and gate and up in
one gate_up_proj ([gate; up]); our merged layers hold the same rows per tensor-parallel rank,
but a rank's rows are its heads of q, of k and of v (its slice of gate and of up), not a
contiguous slice of the fused tensor. So fused_checkpoint_shards splits each fused tensor
into its shards at load, and each shard loads through the layer's weight_loader as a Llama
checkpoint's q_proj / k_proj / v_proj (gate_proj / up_proj) would. LongRoPE
(rope_scaling "longrope", older "su") and partial_rotary_factor (Phi-4-mini) are
engine.layers.rotary's. Sliding windows are capped as for Mistral
(engine.models.hf_config.max_model_len_for).
"""

from __future__ import annotations

from typing import Any

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def fused_checkpoint_shards(self, name: str) -> list[tuple[str, Any, int, int]] | None:
        """[(our parameter, shard id, first row, rows)] of a fused checkpoint tensor; None
        for any other name (the loader's ordinary rules then apply)."""
        cfg = self.config
        if ".self_attn.qkv_proj." in name:
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [(name, "q", 0, q), (name, "k", q, kv), (name, "v", q + kv, kv)]
        if ".mlp.gate_up_proj." in name:
            inter = cfg.intermediate_size
            return [(name, 0, 0, inter), (name, 1, inter, inter)]
        return None
