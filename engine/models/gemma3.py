"""Gemma 3 (text: Gemma3ForCausalLM): the Llama attention with Gemma's pieces around it.

- embeddings scaled by sqrt(hidden_size) (in the model dtype, as HF);
- four norms a layer: before and after attention, before and after the MLP, each output
  added to the residual stream after its post-norm;
- Gemma's RMSNorm scales by (1 + weight): the checkpoint's weights are loaded plus one, so
  the shared RMSNorm (and its fused kernels) computes it;
- q and k normalized per head (Qwen3's way, with Gemma's norm), attention scaled by
  query_pre_attn_scalar ** -0.5;
- GeGLU MLP (gelu_pytorch_tanh);
- layers alternate local (sliding-window) and global attention (config layer_types, or
  every sliding_window_pattern-th layer global), each kind with its own rope: local layers
  rope_local_base_freq (10,000) plain, global ones rope_theta (1,000,000) with its scaling
  (linear, factor 8, in the 4B and larger models);
- the final logits soft-capped where final_logit_softcapping is set (argmax unchanged).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backends.base import AttentionMetadata
from engine.attention.layer import PagedAttention
from engine.distributed import get_pp_size
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.hf_config import HFModelConfig
from engine.models.llama import LlamaAttention

LOCAL_ROPE_THETA = 10_000.0  # transformers' Gemma3TextConfig defaults
GLOBAL_ROPE_THETA = 1_000_000.0


def layer_types(cfg: HFModelConfig) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention" (transformers' rule)."""
    types = cfg.raw.get("layer_types")
    if types:
        return list(types)
    pattern = int(cfg.raw.get("sliding_window_pattern", 6))
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(cfg.num_hidden_layers)
    ]


def rope_parameters(cfg: HFModelConfig) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """layer type -> (rope theta, scaling or None), from either form of the config."""
    raw = cfg.raw
    params = raw.get("rope_parameters") or {}
    out = {}
    for kind, theta_key, default in (
        ("full_attention", "rope_theta", GLOBAL_ROPE_THETA),
        ("sliding_attention", "rope_local_base_freq", LOCAL_ROPE_THETA),
    ):
        p = dict(params.get(kind) or {})
        if not p and kind == "full_attention" and raw.get("rope_scaling"):
            p = dict(raw["rope_scaling"])
        theta = float(p.pop("rope_theta", raw.get(theta_key, default)))
        scaling = p if p.get("rope_type", p.get("type", "default")) != "default" else None
        out[kind] = (theta, scaling)
    return out


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w scales by (1 + w): loaded as 1 + w."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _plus_one


def _plus_one(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"weight shape mismatch: checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}"
        )
    param.data.copy_(loaded.float() + 1.0)


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: HFModelConfig, layer_idx: int, layer_type: str):
        super().__init__(cfg, layer_idx)
        scalar = float(cfg.raw.get("query_pre_attn_scalar", cfg.head_dim))
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            cfg.head_dim,
            scalar**-0.5,
            sliding_window=cfg.layer_sliding_window(layer_idx),  # local layers' window
        )
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.layer_type = layer_type


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: HFModelConfig, layer_idx: int, layer_type: str):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layer_idx, layer_type)
        self.mlp = GatedMLP(h, cfg.intermediate_size, act=cfg.hidden_act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): the next
        layer's input norm adds them, as the Llama layers do."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: HFModelConfig, max_position: int):
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, t) for i, t in enumerate(layer_types(cfg))
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(cfg.head_dim, max_position, theta, scaling)
                for kind, (theta, scaling) in rope_parameters(cfg).items()
            }
        )

    def own_layers(self) -> list[Gemma3DecoderLayer]:
        """This rank's layers: all of them (Gemma 3 is not split into pipeline stages)."""
        return list(self.layers)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)
        ropes = {kind: r.lookup(positions, hidden.dtype) for kind, r in self.rotary.items()}
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, ropes[layer.self_attn.layer_type], meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: HFModelConfig, max_position: int | None = None):
        super().__init__()
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "silu"):
            raise ValueError(f"hidden_activation {cfg.hidden_act!r} is not supported for Gemma 3")
        if cfg.raw.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 leaves it unset)")
        if get_pp_size() > 1:
            raise ValueError(
                "Gemma 3 is not split into pipeline stages yet: drop --pipeline-parallel-size"
            )
        self.config = cfg
        self.model = Gemma3Model(cfg, max(cfg.max_position_embeddings, max_position or 0))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:  # as Gemma's checkpoints do
            self.lm_head.tie_to(self.model.embed_tokens)
        self.softcap = cfg.raw.get("final_logit_softcapping")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.greedy(hidden)  # soft-capping keeps the order

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
