"""One Llama-family implementation: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2
(qkv bias), Qwen3 (an RMSNorm over each head of q and k), SmolLM; Phi-3 / Phi-4 (LongRoPE,
partial rotary) through engine.models.phi3. The MLP is pluggable: make_mlp(cfg, layer_idx)
builds each layer's (the mixtures of experts of engine.models.moe). Each layer's attention
takes its sliding window from the config (cfg.layer_sliding_windows: Mistral every layer,
Qwen2/3 per use_sliding_window / max_window_layers / layer_types).

forward(input_ids [T], positions [T], attn_metadata) -> hidden [T, H] over a flattened batch;
compute_logits(hidden [S, H]) -> [S, V] float32.

Pipeline parallelism (engine.models.pipeline): a stage builds only its layers (the first also
the embedding, the last the final norm and the LM head); forward takes the previous stage's
IntermediateTensors and, on every stage but the last, returns its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention.backends.base import AttentionMetadata
from engine.attention.layer import PagedAttention
from engine.distributed import get_pp_rank, get_pp_size
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import ApplyRotary, RotaryEmbedding
from engine.models.hf_config import HFModelConfig
from engine.models.pipeline import IntermediateTensors, PPMissingLayer, layer_range


def rotary_dim(cfg: HFModelConfig) -> int:
    """The dims of each head that rotary rotates (transformers: int(head_dim * factor))."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: HFModelConfig, layer_idx: int = 0):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's share
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias
        )
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            cfg.head_dim,
            scale=cfg.head_dim**-0.5,
            sliding_window=cfg.layer_sliding_window(layer_idx),
            sinks=cfg.attention_sinks,
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = ApplyRotary()
        self.rotary_dim = rotary_dim(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden).view(t, h + 2 * hkv, d)
        qk = qkv[:, : h + hkv]
        if self.q_norm is not None:  # Qwen3: each head of q and k normalized before rotary
            q = self.q_norm(qk[:, :h].reshape(t * h, d)).view(t, h, d)
            k = self.k_norm(qk[:, h:].reshape(t * hkv, d)).view(t, hkv, d)
            qk = torch.cat((q, k), dim=1)
        # q and k are adjacent: rotate both with one set of ops.
        r = self.rotary_dim
        if r == d:
            qk = self.rotary(qk, *rope)
        else:  # partial rotary (Phi-4-mini): the first r dims of each head; the rest pass
            qk = torch.cat((self.rotary(qk[..., :r].contiguous(), *rope), qk[..., r:]), dim=-1)
        o = self.attn(qk[:, :h], qk[:, h:], qkv[:, h + hkv :], meta)
        return self.o_proj(o)


class LlamaMLP(GatedMLP):
    def __init__(self, cfg: HFModelConfig):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)


def dense_mlp(cfg: HFModelConfig, layer_idx: int) -> nn.Module:
    return LlamaMLP(cfg)


class LlamaDecoderLayer(nn.Module):
    """Attention, then the MLP: the dense gated MLP, or what the model's make_mlp builds for
    this layer (a mixture of experts: engine.models.moe)."""

    def __init__(self, cfg: HFModelConfig, mlp: nn.Module | None = None, layer_idx: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: HFModelConfig,
        max_position: int,
        make_mlp: Callable[[HFModelConfig, int], nn.Module] = dense_mlp,
    ):
        super().__init__()
        pp_rank, pp_size = get_pp_rank(), get_pp_size()
        self.first_stage, self.last_stage = pp_rank == 0, pp_rank == pp_size - 1
        self.start_layer, self.end_layer = layer_range(cfg.num_hidden_layers, pp_rank, pp_size)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
            if self.first_stage
            else PPMissingLayer()
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, make_mlp(cfg, i), i)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.last_stage else None
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, rotary_dim(cfg)
        )
        # An EAGLE-3 head reads the residual stream entering these layers (vLLM's ids: i is
        # layer i's input, HF's hidden_states[i]); each forward leaves them in
        # aux_hidden_states, in layer order.
        self.aux_hidden_layers: frozenset[int] = frozenset()
        self.aux_hidden_states: list[torch.Tensor] = []

    def own_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's layers, in order (all of them without pipeline parallelism)."""
        return list(self.layers[self.start_layer : self.end_layer])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary_emb.lookup(positions, hidden.dtype)  # once per step, for every layer
        aux = self.aux_hidden_layers
        if aux:
            self.aux_hidden_states = []
        for i in range(self.start_layer, self.end_layer):
            if i in aux:  # a copy: layer 0 takes its input as the residual, updated in place
                self.aux_hidden_states.append(
                    hidden.clone() if residual is None else hidden + residual
                )
            hidden, residual = self.layers[i](hidden, residual, rope, meta)
        if not self.last_stage:
            return IntermediateTensors(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Checkpoint name fragment -> (our merged parameter fragment, shard id).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # layer index -> its MLP (a subclass's mixture of experts, engine.models.moe)
    make_mlp = staticmethod(dense_mlp)

    def __init__(self, cfg: HFModelConfig, max_position: int | None = None):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        self.config = cfg
        self.model = LlamaModel(
            cfg, max(cfg.max_position_embeddings, max_position or 0), self.make_mlp
        )
        self.lm_head = None
        if self.model.last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if cfg.tie_word_embeddings and self.model.first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, meta, intermediate)

    def stage_checkpoint_name(self, name: str) -> str | None:
        """Under pipeline parallelism: the name this stage loads a checkpoint tensor as
        (a tied LM head on a last stage without the embedding: the embedding's tensor), or
        None for a tensor of another stage (skipped)."""
        m = self.model
        if name.startswith("model.layers."):
            i = int(name.split(".", 3)[2])
            return name if m.start_layer <= i < m.end_layer else None
        if name.startswith("model.embed_tokens."):
            if m.first_stage:
                return name
            if (
                self.lm_head is not None
                and not self.lm_head.tied
                and self.config.tie_word_embeddings
            ):
                return name.replace("model.embed_tokens.", "lm_head.")
            return None
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return name if m.last_stage else None
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(compute_logits(hidden)) per row where the LM head can take it without the
        logits (engine.layers.embedding.ParallelLMHead.greedy), else None."""
        return self.lm_head.greedy(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        """The attention modules, in order: the runner binds one KV-cache tensor to each."""
        return [layer.self_attn.attn for layer in self.model.own_layers()]
