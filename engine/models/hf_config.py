"""HFModelConfig: the few fields of a Hugging Face config.json the engine needs.

Reads both rope formats: transformers 5 "rope_parameters" and the older "rope_theta" +
"rope_scaling" that most checkpoints on disk still carry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class HFModelConfig:
    architecture: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain rope; else has "rope_type"
    # (longrope: short_factor, long_factor, original_max_position_embeddings and factor)
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2: True)
    qk_norm: bool  # an RMSNorm over each head of q and k before rotary (Qwen3)
    o_proj_bias: bool
    mlp_bias: bool
    hidden_act: str
    dtype: str | None  # the checkpoint's torch dtype name, e.g. "bfloat16"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Each layer's sliding window (None: full attention), transformers' rule for the model
    # (_layer_sliding_windows); empty: none anywhere. sliding_window: the largest of them.
    layer_sliding_windows: list[int | None] = field(default_factory=list)
    sliding_window: int | None = None
    # rotary on the first int(head_dim * partial_rotary_factor) dims of each head (Phi-4-mini)
    partial_rotary_factor: float = 1.0
    # config.json as read: a model's own fields (engine.models.gemma3 reads its rope bases,
    # layer types and scalars from it)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # gpt-oss: a learned logit per attention head in every softmax, with no value
    attention_sinks: bool = False
    # Mixture of experts (0 experts: a dense model). Layer i has the experts unless it is in
    # mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (Qwen's rule; Mixtral: every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k weights to sum to 1 (Mixtral: always)
    moe_scoring_func: str = "softmax"
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # the checkpoint's stacked gate_up rows interleave gate and up (gpt-oss) rather than
    # concatenating them (engine.models.gpt_oss loads them; LoRA adapters' B rows alike)
    moe_gate_up_interleaved: bool = False

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        windows = self.layer_sliding_windows
        return windows[layer_idx] if windows else None

    def kv_sliding_window(self) -> int | None:
        """The window the KV cache may drop blocks behind: the largest window where every
        layer has one (a block out of every layer's window is read by none); None where any
        layer attends globally (a hybrid model keeps every block) or none has a window."""
        windows = self.layer_sliding_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    # config.json's quantization_config (a quantized checkpoint's format), None for float ones
    quantization_config: dict[str, Any] | None = None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, the scaling dict or None, partial_rotary_factor)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params:
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    partial = float(
        scaling.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0
    )
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if raw.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's older names for it (transformers' Phi3Config maps them)
    if rope_type == "default":
        return theta, None, partial
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        _longrope(raw, scaling)
    elif rope_type == "yarn":
        _yarn(raw, scaling)
    return theta, scaling, partial


def _yarn(raw: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Complete a yarn scaling dict as transformers reads it (_original_context)."""
    _original_context(raw, scaling, "yarn")


def _longrope(raw: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Complete a longrope scaling dict as transformers reads it: both factor lists, and
    _original_context (Phi-3 keeps original_max_position_embeddings at the top level)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ValueError(f"rope_scaling type 'longrope' needs a {key} list")
    _original_context(raw, scaling, "longrope")


def _original_context(raw: dict[str, Any], scaling: dict[str, Any], rope_type: str) -> None:
    """scaling's original_max_position_embeddings (required: in scaling or at the config's top
    level) and factor (when absent: max_position_embeddings / original)."""
    original = scaling.get("original_max_position_embeddings") or raw.get(
        "original_max_position_embeddings"
    )
    if not original:
        raise ValueError(f"rope_scaling type {rope_type!r} needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original)
    if scaling.get("factor") is None:
        scaling["factor"] = int(raw.get("max_position_embeddings", 2048)) / int(original)


def _layer_sliding_windows(raw: dict[str, Any], num_layers: int) -> list[int | None]:
    """Each layer's window as transformers (5.x) decides it; a list, since models alternate.

    - Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE: none without use_sliding_window. With it: the
      layers layer_types marks "sliding_attention"; without layer_types, transformers'
      default for it: Qwen2 and Qwen3 layers >= max_window_layers (28 unless given),
      Qwen2-MoE the even layers below max_window_layers; Qwen3-MoE every layer (its
      attention reads sliding_window, not layer_types).
    - Any other model with layer_types (Ministral, Gemma 3, gpt-oss): the layers it marks;
      Gemma 3 without them: every sliding_window_pattern-th layer (6) global, the rest local.
    - Else (Mistral, Mixtral): every layer.
    Empty where no layer has one.
    """
    window = raw.get("sliding_window")
    if not window:
        return []
    window = int(window)
    model_type = raw.get("model_type")
    types = raw.get("layer_types")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not raw.get("use_sliding_window", False):
            return []
        first = int(raw.get("max_window_layers", 28))
        if model_type == "qwen3_moe":
            types = None
        elif not types and model_type == "qwen2_moe":
            types = [
                "sliding_attention" if i % 2 == 0 and i < first else "full_attention"
                for i in range(num_layers)
            ]
        elif not types:
            types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
    if not types and model_type == "gemma3_text":  # transformers' Gemma3TextConfig default
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        windows = [window if t == "sliding_attention" else None for t in types]
        return windows if any(w is not None for w in windows) else []
    return [window] * num_layers


def _quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    q = raw.get("quantization_config") or raw.get("compression_config")  # CT's older key
    return dict(q) if isinstance(q, dict) else None


def parse_hf_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> HFModelConfig:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    theta, scaling, partial_rotary_factor = _rope(raw)
    if model_type == "qwen2_moe":  # transformers 5 names it qkv_bias; older configs omit it
        attention_bias = bool(raw.get("qkv_bias", raw.get("attention_bias", True)))
    else:
        attention_bias = bool(raw.get("attention_bias", model_type == "qwen2"))
    eos = _ids(raw.get("eos_token_id"))
    for tok in _ids((generation or {}).get("eos_token_id")):
        if tok not in eos:
            eos.append(tok)
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    num_layers = int(raw["num_hidden_layers"])
    windows = _layer_sliding_windows(raw, num_layers)
    return HFModelConfig(
        architecture=archs[0] if archs else "",
        model_type=model_type,
        num_hidden_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        o_proj_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=raw.get("hidden_act") or raw.get("hidden_activation") or "silu",
        dtype=str(dtype) if dtype else None,
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        layer_sliding_windows=windows,
        sliding_window=max((w for w in windows if w is not None), default=None),
        partial_rotary_factor=partial_rotary_factor,
        attention_sinks=model_type == "gpt_oss",
        quantization_config=_quantization_config(raw),
        raw=raw,
        **_moe(raw, model_type),
    )


def _moe(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields: Mixtral's num_local_experts (its experts as wide as intermediate_size,
    top-k always renormalized), Qwen's num_experts / moe_intermediate_size / norm_topk_prob."""
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if not experts:
        return {}
    # Mixtral always renormalizes the top-k weights; gpt-oss softmaxes the top-k logits
    # (the same weights)
    renormalized = model_type in ("mixtral", "gpt_oss")
    inter = raw.get("moe_intermediate_size") or raw["intermediate_size"]
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(inter),
        norm_topk_prob=True if renormalized else bool(raw.get("norm_topk_prob", False)),
        moe_scoring_func=str(raw.get("scoring_func", "softmax")),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=[int(i) for i in raw.get("mlp_only_layers") or []],
        moe_gate_up_interleaved=model_type == "gpt_oss",
    )


def load_hf_config(model_dir: str | Path) -> HFModelConfig:
    """Parse model_dir/config.json (and generation_config.json's eos ids, if present)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a model folder: config.json is missing")
    raw = json.loads(path.read_text())
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    try:
        return parse_hf_config(raw, generation)
    except KeyError as e:
        raise ValueError(f"{path} lacks the field {e.args[0]!r}") from None


# generation_config.json's sampling fields -> SamplingParams' names: the defaults a request
# falls back to for what it leaves unset (vLLM's --generation-config auto).
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_dir: str | Path, generation_config: str) -> dict[str, Any]:
    """The sampling defaults of --generation-config: `auto`, the model folder's
    generation_config.json (none where it has none); `vllm`, none (the API's own defaults);
    else a folder holding a generation_config.json."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config == "auto":
            return {}
        raise ValueError(
            f"generation_config {generation_config!r}: no generation_config.json there"
        )
    raw = json.loads(path.read_text())
    return {
        ours: raw[theirs]
        for theirs, ours in _GENERATION_DEFAULTS.items()
        if raw.get(theirs) is not None
    }


def max_model_len_for(cfg: HFModelConfig, requested: int | None) -> int:
    """The context length to serve: the model's own (max_position_embeddings, a sliding-window
    model's too: its layers attend within their windows) unless a shorter one is requested."""
    limit = cfg.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} is longer than the model supports: "
            f"max_position_embeddings ({limit}); lower --max-model-len to at most {limit}"
        )
    return requested
