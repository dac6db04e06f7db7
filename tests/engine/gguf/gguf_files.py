"""Tiny GGUF files for tests: an HF folder's weights written by gguf-py's writer, the linear
layers in a block type (K-quants and IQ4 from the tests' numpy encoder: gguf-py has none for
them)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from tests.engine.kernels import kquant_blocks

HEADS, KV_HEADS = 4, 2  # tests/conftest.py's tiny Llama
_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    if type_name in kquant_blocks.TYPES:
        return kquant_blocks.quantize(w, type_name)
    return quantize(w, GGMLQuantizationType[type_name])


def write_gguf(
    hf_dir,
    path,
    type_name: str,
    overrides: dict | None = None,
    head_type: str | None = None,
    arch: str = "llama",
    embed_type: str | None = None,
) -> None:
    """Every linear weight in type_name; overrides: {gguf part or (layer, part): type name};
    the LM head (output.weight) in head_type, float32 without one, and token_embd in
    embed_type (float32 without one). arch "qwen2" / "qwen3": q/k rows as HF has them
    (llama.cpp permutes llama's only), Qwen2's q/k/v biases, Qwen3's q/k norms."""
    state = load_file(str(hf_dir / "model.safetensors"))
    overrides = overrides or {}
    writer = GGUFWriter(str(path), arch)
    for name, t in state.items():
        w = t.float().numpy()
        if name == "model.embed_tokens.weight" and embed_type is None:
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.embed_tokens.weight":
            q = _quantize(np.ascontiguousarray(w), embed_type)
            writer.add_tensor(
                "token_embd.weight",
                q,
                raw_shape=q.shape,
                raw_dtype=GGMLQuantizationType[embed_type],
            )
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight" and head_type is None:
            writer.add_tensor("output.weight", w)
        elif name == "lm_head.weight":
            q = _quantize(np.ascontiguousarray(w), head_type)
            writer.add_tensor(
                "output.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[head_type]
            )
        else:
            _, _, layer, rest = name.split(".", 3)
            if rest.endswith(".bias"):
                writer.add_tensor(f"blk.{layer}.{_NAMES[rest.removesuffix('.bias')]}.bias", w)
                continue
            module = rest.removesuffix(".weight")
            if arch == "llama" and module.endswith(("q_proj", "k_proj")):
                w = _permute(w, HEADS if module.endswith("q_proj") else KV_HEADS)
            part = _NAMES[module]
            if w.ndim == 2:
                t = overrides.get((int(layer), part), overrides.get(part, type_name))
                if t in ("F16", "F32"):  # a float tensor, as the writer stores numpy's
                    dtype = np.float16 if t == "F16" else np.float32
                    writer.add_tensor(f"blk.{layer}.{part}.weight", w.astype(dtype))
                    continue
                q = _quantize(np.ascontiguousarray(w), t)
                writer.add_tensor(
                    f"blk.{layer}.{part}.weight",
                    q,
                    raw_shape=q.shape,
                    raw_dtype=GGMLQuantizationType[t],
                )
            else:
                writer.add_tensor(f"blk.{layer}.{_NAMES[module]}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
