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
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2: True)
    qk_norm: bool  # an RMSNorm over each head of q and k before rotary (Qwen3)
    o_proj_bias: bool
    mlp_bias: bool
    hidden_act: str
    dtype: str | None  # the checkpoint's torch dtype name, e.g. "bfloat16"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    sliding_window: int | None = None  # only when the model actually uses it
    # config.json's quantization_config (a quantized checkpoint's format), None for float ones
    quantization_config: dict[str, Any] | None = None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params:
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def _sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if not window:
        return None
    if raw.get("model_type") in ("qwen2", "qwen3"):
        # Qwen2/3 configs carry a window but only use it with use_sliding_window.
        uses = raw.get("use_sliding_window", False) or "sliding_attention" in (
            raw.get("layer_types") or []
        )
        if not uses:
            return None
    return int(window)


def _quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    q = raw.get("quantization_config") or raw.get("compression_config")  # CT's older key
    return dict(q) if isinstance(q, dict) else None


def parse_hf_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> HFModelConfig:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    theta, scaling = _rope(raw)
    attention_bias = bool(raw.get("attention_bias", model_type == "qwen2"))
    eos = _ids(raw.get("eos_token_id"))
    for tok in _ids((generation or {}).get("eos_token_id")):
        if tok not in eos:
            eos.append(tok)
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return HFModelConfig(
        architecture=archs[0] if archs else "",
        model_type=model_type,
        num_hidden_layers=int(raw["num_hidden_layers"]),
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
        qk_norm=model_type == "qwen3",
        o_proj_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        dtype=str(dtype) if dtype else None,
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        sliding_window=_sliding_window(raw),
        quantization_config=_quantization_config(raw),
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


def max_model_len_for(cfg: HFModelConfig, requested: int | None) -> int:
    """The context length to serve: the model's own unless a shorter one is requested.

    Sliding-window attention is not implemented, so a model whose window is shorter than the
    context is capped at the window (full attention within it is then exact).
    """
    limit = cfg.max_position_embeddings
    if cfg.sliding_window is not None:
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return limit
    if requested > limit:
        why = (
            f"its sliding window ({cfg.sliding_window} tokens; sliding-window attention is "
            "not supported)"
            if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings
            else f"max_position_embeddings ({cfg.max_position_embeddings})"
        )
        raise ValueError(
            f"max_model_len {requested} is longer than the model supports: {why}; "
            f"lower --max-model-len to at most {limit}"
        )
    return requested
