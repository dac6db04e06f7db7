"""EAGLE-3 heads (vLLM's and SpecForge's `LlamaForCausalLMEagle3` layout).

The head reads the target's residual stream entering a few of its layers (the config's
`eagle_aux_hidden_state_layer_ids`, else layers 2, L // 2 and L - 3 as vLLM picks them; id i
is layer i's input, HF's hidden_states[i]), concatenated in layer order and projected by
`fc` [H, n * target_hidden]. Its one decoder layer (`midlayer.*`) takes
concat(input_layernorm(embed(x_{p+1})), hidden_norm(h_p)): q/k/v are 2H wide; the residual
is h_p itself (or, with the config's `norm_before_residual`, its norm). The layer's output
plus the residual is the feature the next draft step reads; after the head's own `norm` its
`lm_head` scores a draft vocabulary, mapped to the target's by `d2t` (target id = draft id +
d2t[draft id]; `t2d` is not needed). The embedding is the target's, or the checkpoint's own
`embed_tokens` where it has one.

Feeding is EAGLE-1's (engine.spec_decode.eagle): after each step the head reads the step's
kept rows, then k - 1 one-token steps from its own features. The target captures the aux
states in its modules' forward (LlamaModel.aux_hidden_layers); CUDA graphs keep them as
outputs of their own (engine.worker.cuda_graph.aux_module), the CPU's decode plan does not,
so on the CPU every step with an EAGLE-3 head runs the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import QKVParallelLinear, ReplicatedLinear
from engine.layers.norm import RMSNorm
from engine.layers.ops import bind_custom_ops
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from engine.models.loader import _default_dtype
from engine.spec_decode.eagle import EagleProposer, head_weight_names, load_head_weights

if TYPE_CHECKING:
    from engine.attention.backends.base import AttentionMetadata
    from engine.models.hf_config import HFModelConfig

_LAYOUT = "fc.weight, midlayer.*, norm.weight, lm_head.weight and d2t / t2d"


def aux_layer_ids(raw: dict[str, Any], num_layers: int) -> list[int]:
    """The target layers whose input the head reads, in layer order: the config's
    eagle_aux_hidden_state_layer_ids (top level or under eagle_config), else vLLM's default."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(raw.get("eagle_config"), dict):
        ids = raw["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    given = ids is not None
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    if (
        not isinstance(ids, list)
        or not ids
        or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
        or len(set(ids)) != len(ids)
        or not all(0 <= i < num_layers for i in ids)
    ):
        where = "its eagle_aux_hidden_state_layer_ids" if given else "the default layers"
        raise ValueError(
            f"speculative_config: the EAGLE-3 head's aux layers ({where}: {ids!r}) must be "
            f"distinct layer ids of the target, 0 to {num_layers - 1}: set "
            "eagle_aux_hidden_state_layer_ids in the head's config.json"
        )
    return sorted(ids)


class Eagle3Head(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(
        self,
        cfg: HFModelConfig,
        fc_in: int,
        draft_vocab: int,
        max_position: int,
        own_embed: bool,
        has_d2t: bool,
        fc_bias: bool = False,
    ):
        super().__init__()
        h = cfg.hidden_size
        self.fc = ReplicatedLinear(fc_in, h, bias=fc_bias)
        layer = LlamaDecoderLayer(cfg, None, 0)
        # q/k/v read the normed embedding and the normed feature side by side
        layer.self_attn.qkv_proj = QKVParallelLinear(
            2 * h,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            bias=cfg.attention_bias,
        )
        layer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(draft_vocab, h)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h) if own_embed else None
        self.d2t = (
            nn.Parameter(torch.zeros(draft_vocab, dtype=torch.long), requires_grad=False)
            if has_d2t
            else None
        )
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim,
            max(cfg.max_position_embeddings, max_position),
            cfg.rope_theta,
            cfg.rope_scaling,
        )
        self.norm_before_residual = bool(cfg.raw.get("norm_before_residual", False))

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the LM head, pre-norm output: the next step's features)."""
        layer = self.layers[0]
        embeds = layer.input_layernorm(embeds)
        if self.norm_before_residual:
            x = layer.hidden_norm(features)
            residual = x
        else:
            residual, x = features, layer.hidden_norm(features)
        x = torch.cat((embeds, x), dim=-1)
        rope = self.rotary_emb.lookup(positions, x.dtype)
        h = layer.self_attn(x, rope, meta)
        h, residual = layer.post_attention_layernorm(h, residual)
        return self.norm(layer.mlp(h), residual)

    def attention_layers(self) -> list:
        return [self.layers[0].self_attn.attn]

    def draft_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row, as a target token id."""
        ids = self.lm_head.greedy(hidden)
        if ids is None:
            ids = self.lm_head(hidden).argmax(-1)
        return ids if self.d2t is None else ids + self.d2t[ids]


class Eagle3Proposer(EagleProposer):
    what = "EAGLE-3 head"

    def _load(
        self, target_config: HFModelConfig, path: str, dtype: torch.dtype, seed: int
    ) -> nn.Module:
        cfg, raw = self.hf_config, self.hf_config.raw
        model = getattr(self.target, "model", None)
        if not isinstance(model, LlamaModel):
            raise ValueError(
                "speculative_config: an EAGLE-3 head reads the hidden states of a "
                f"Llama-family target (Llama, Mistral, Qwen2/3), not {target_config.architecture}"
            )
        if target_config.kv_sliding_window() is not None:
            raise ValueError(
                "speculative_config: EAGLE-3 is not supported with a target whose every layer "
                "has a sliding window"
            )
        layers = aux_layer_ids(raw, target_config.num_hidden_layers)
        target_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
        if target_hidden != target_config.hidden_size:
            raise ValueError(
                f"speculative_config: the EAGLE-3 head {path!r} reads hidden states of size "
                f"{target_hidden}, the target's are {target_config.hidden_size}: it must be "
                "trained for this target"
            )
        if cfg.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"speculative_config: the EAGLE-3 head {path!r} has vocab_size "
                f"{cfg.vocab_size}, the target {target_config.vocab_size}"
            )
        names = head_weight_names(self.model_dir, "EAGLE-3 head")
        own_embed = "embed_tokens.weight" in names
        if not own_embed and cfg.hidden_size != target_config.hidden_size:
            raise ValueError(
                f"speculative_config: the EAGLE-3 head {path!r} has hidden size "
                f"{cfg.hidden_size} and no embed_tokens of its own: it must match the "
                f"target's ({target_config.hidden_size}) to use the target's embedding"
            )
        draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        has_d2t = "d2t" in names
        if draft_vocab != cfg.vocab_size and not has_d2t:
            raise ValueError(
                f"speculative_config: the EAGLE-3 head {path!r} scores {draft_vocab} draft "
                f"tokens of the target's {cfg.vocab_size} but has no d2t map"
            )
        with _default_dtype(dtype), torch.device(self.device):
            head = Eagle3Head(
                cfg,
                len(layers) * target_hidden,
                draft_vocab,
                self.max_model_len,
                own_embed,
                has_d2t,
                fc_bias="fc.bias" in names,
            )
        tensors = {}
        for name, file in names.items():
            if name == "t2d" or "rotary_emb.inv_freq" in name:
                continue
            tensors[name.replace("midlayer.", "layers.0.", 1)] = (name, file)
        load_head_weights(head, self.model_dir, tensors, "EAGLE-3 head", _LAYOUT)
        if head.d2t is not None:
            mapped = torch.arange(draft_vocab, device=self.device) + head.d2t
            if mapped.min() < 0 or mapped.max() >= target_config.vocab_size:
                raise ValueError(
                    f"speculative_config: the EAGLE-3 head {path!r} maps draft ids outside "
                    f"the target's vocabulary of {target_config.vocab_size} (d2t)"
                )
        bind_custom_ops(head, self.device)
        self.aux_layers = layers
        model.aux_hidden_layers = frozenset(layers)  # the target keeps them from now on
        return head.eval()

    def step_features(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """The target's aux states of the step just run, side by side [T, n * H]."""
        model = self.target.model
        aux, model.aux_hidden_states = model.aux_hidden_states, []  # held no longer than needed
        assert len(aux) == len(self.aux_layers), "the step ran without the target's modules"
        return torch.cat(aux, dim=-1)

    def _target_features(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.fc(rows)

    def _run_head(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.model.embed_tokens
        embeds = embed(input_ids) if embed is not None else self.vocab.embed(input_ids)
        return self.model(embeds, features, positions, meta)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        return self.model.draft_argmax(hidden).tolist()
