"""config.json entries of the GGUF architectures that are more than the Llama decoder: qwen2moe's
and qwen3moe's experts (qwen2moe's shared expert), gemma3's windows, rope bases and attention scale, phi3's LongRoPE and partial rotary,
gpt-oss's experts, windows and yarn.

Each is read from the metadata keys and tensors llama.cpp's convert_hf_to_gguf.py writes, and
where llama.cpp fixes a value in its loader instead of the file (gemma3's window pattern, local
rope base and query scale), the value it fixes. engine.gguf.convert adds them to the Llama
entries it reads for every architecture.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

# llama.cpp's gemma3 loader: every 6th layer global unless the file gives a pattern, the local
# layers' rope base 10,000 unscaled, and queries scaled by head_dim ** -0.5 except in the 27B
# model (62 layers), whose query_pre_attn_scalar is hidden_size / heads
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62

Key = Callable[..., object]  # key(name, default=None): the file's f"{arch}.{name}" value


def _experts(arch: str, key: Key, tensors: dict, config: dict, norm_default: bool) -> dict:
    """Experts: count, used per token, their width; the layers without a router
    (ffn_gate_inp) are dense (mlp_only_layers); the top-k weights renormalized where the file
    says so (expert_weights_norm), else as llama.cpp's loader of that architecture does."""
    experts = key("expert_count")
    if not experts:
        raise ValueError(f"a {arch} GGUF file without {arch}.expert_count")
    dense = [
        i
        for i in range(config["num_hidden_layers"])
        if f"blk.{i}.ffn_gate_inp.weight" not in tensors
    ]
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "norm_topk_prob": bool(key("expert_weights_norm", norm_default)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "use_sliding_window": False,
    }


def qwen3moe(key: Key, tensors: dict, config: dict) -> dict:
    """llama.cpp's qwen3moe renormalizes the top-k weights; no attention biases."""
    return {**_experts("qwen3moe", key, tensors, config, True), "attention_bias": False}


def qwen2moe(key: Key, tensors: dict, config: dict) -> dict:
    """llama.cpp's qwen2moe: q/k/v biases, top-k weights not renormalized, and a shared expert
    every token runs (ffn_{gate,up,down}_shexp, expert_shared_feed_forward_length wide) scaled
    by sigmoid(ffn_gate_inp_shexp x)."""
    shared = key("expert_shared_feed_forward_length")
    if shared is None:  # the width from the tensor (stored (H, I)), where the key is missing
        t = next((t for n, t in tensors.items() if n.endswith("ffn_gate_shexp.weight")), None)
        shared = 0 if t is None else int(t.shape[1])
    return {
        **_experts("qwen2moe", key, tensors, config, False),
        "shared_expert_intermediate_size": int(shared),
    }


def gemma3_layer_types(num_layers: int, window, pattern) -> list[str]:
    """Each layer's attention as llama.cpp's gemma3 decides it: none local without a window;
    else the file's pattern, per layer (true: local) or every pattern-th layer global."""
    if not window:
        return ["full_attention"] * num_layers
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"gemma3 sliding_window_pattern has {len(pattern)} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    n = int(pattern)
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]


def gemma3(key: Key, tensors: dict, config: dict) -> dict:
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    window = key("attention.sliding_window")
    pattern = key("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if layers == GEMMA3_27B_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = head_dim
    softcap = key("final_logit_softcapping")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "layer_types": gemma3_layer_types(layers, window, pattern),
        "sliding_window": int(window) if window else None,
        "final_logit_softcapping": float(softcap) if softcap else None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


def _factors(t) -> list[float]:
    return [float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1)]


def phi3(key: Key, tensors: dict, config: dict) -> dict:
    """Heads hidden / heads wide, rotary on rope.dimension_count of them (Phi-4-mini: half);
    LongRoPE from the rope_factors_long / rope_factors_short tensors (the file has no scaling
    type), its attention factor the file's where it is not the default; a window of 0 is
    none (Phi-4)."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rope_dims = int(key("rope.dimension_count", head_dim))
    context = config["max_position_embeddings"]
    original = int(key("rope.scaling.original_context_length", context))
    window = key("attention.sliding_window")
    out = {
        "head_dim": head_dim,
        "partial_rotary_factor": rope_dims / head_dim,
        "original_max_position_embeddings": original,
        "sliding_window": int(window) if window else None,
        "attention_bias": False,
        "rope_scaling": None,
    }
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is None and short is None:
        return out
    if long is None or short is None:
        raise ValueError("a phi3 GGUF file with one of rope_factors_long / rope_factors_short")
    scaling = {
        "rope_type": "longrope",
        "long_factor": _factors(long),
        "short_factor": _factors(short),
        "original_max_position_embeddings": original,
    }
    scale = context / original
    default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    attn = key("rope.scaling.attn_factor")
    if attn is not None and abs(float(attn) - default) > 1e-5 * default:
        scaling["attention_factor"] = float(attn)
    out["rope_scaling"] = scaling
    return out


# llama.cpp's gpt-oss loader: every other layer windowed from the first (set_swa_pattern(2),
# gemma3_layer_types' rule), and its graph's fixed SwiGLU (alpha, limit), which the file omits
GPT_OSS_SWA_PATTERN = 2
GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT = 1.702, 7.0


def gpt_oss(key: Key, tensors: dict, config: dict) -> dict:
    """llama.cpp's gpt-oss (convert_hf_to_gguf's GptOssModel): experts expert_feed_forward_length
    wide with biases (gate, up and down stacked apart: a file with ffn_gate_up_exps fused is
    refused), attention biases and sinks, windowed layers alternating with global ones, and
    the checkpoint's yarn rope, which gpt-oss runs untruncated (HF's truncate: false)."""
    fused = next((n for n in tensors if n.endswith("ffn_gate_up_exps.weight")), None)
    if fused is not None:
        raise ValueError(
            f"gpt-oss GGUF tensor {fused}: fused gate/up experts are not supported (files "
            "with ffn_gate_exps and ffn_up_exps are)"
        )
    experts = key("expert_count")
    if not experts:
        raise ValueError("a gpt-oss GGUF file without gpt-oss.expert_count")
    window = key("attention.sliding_window")
    scaling = config["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling = {**scaling, "truncate": False}
    return {
        "num_local_experts": int(experts),
        "num_experts_per_tok": int(key("expert_used_count")),
        "intermediate_size": int(key("expert_feed_forward_length")),
        "sliding_window": int(window) if window else None,
        "layer_types": gemma3_layer_types(config["num_hidden_layers"], window, GPT_OSS_SWA_PATTERN),
        "attention_bias": True,
        "swiglu_alpha": GPT_OSS_SWIGLU_ALPHA,
        "swiglu_limit": GPT_OSS_SWIGLU_LIMIT,
        "rope_scaling": scaling,
    }


# GGUF architecture -> (HF's class, HF's model_type, its entries beyond the Llama decoder's)
ARCHS: dict[str, tuple[str, str, Callable[[Key, dict, dict], dict] | None]] = {
    "llama": ("LlamaForCausalLM", "llama", None),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", None),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", None),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", qwen2moe),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", qwen3moe),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", gemma3),
    "phi3": ("Phi3ForCausalLM", "phi3", phi3),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", gpt_oss),
}
