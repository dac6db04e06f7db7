"""Tiny GGUF files for tests: an HF folder's weights written by gguf-py's writer, the linear
layers in a block type (K-quants and IQ4 from the tests' numpy encoder: gguf-py has none for
them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
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


# -- whole files as llama.cpp's convert_hf_to_gguf.py writes them --------------------------

# HF model_type -> llama.cpp's architecture
LLAMA_CPP_ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gemma3_text": "gemma3",
                   "phi3": "phi3"}  # fmt: skip
_COMMON = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
}  # fmt: skip
_ARCH_NAMES = {
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "qwen2moe": {  # the shared expert and its gate (tensor_mapping.py's *_SHEXP)
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    },
}


def _tokenizer_metadata(
    writer: GGUFWriter, hf_dir: Path, pre: str = "default", control: tuple[str, ...] = ()
) -> None:
    """The tests' byte-level BPE tokenizer as llama.cpp's gpt2 vocabulary (control: added
    tokens llama.cpp's converter marks CONTROL, as o200k_harmony's markers)."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    special = set()
    for added in tj.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special") or added["content"] in control:
            special.add(added["id"])
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    config = json.loads((hf_dir / "config.json").read_text())
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    if tc.get("unk_token") in vocab:  # (SpecialVocab writes it where the tokenizer has one)
        writer.add_unk_token_id(vocab[tc["unk_token"]])
    template = tc.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _hparams(writer: GGUFWriter, arch: str, c: dict) -> None:
    """The metadata keys convert_hf_to_gguf.py writes for these architectures."""
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c.get("rope_parameters") or {}
    if arch == "phi3":  # Phi3MiniModel: no key_length; rotary dims from hidden / heads
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        rot = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(rot * c["hidden_size"]) // c["num_attention_heads"])
        writer.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        writer.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
        writer.add_sliding_window(c.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
            orig = c["original_max_position_embeddings"]
            attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attn)
            long = np.asarray(rope["long_factor"], dtype=np.float32)
            short = np.asarray(rope["short_factor"], dtype=np.float32)
            assert len(long) == int(rot * head_dim) // 2
            writer.add_tensor("rope_factors_long.weight", long)
            writer.add_tensor("rope_factors_short.weight", short)
        return
    if "head_dim" in c:  # convert_hf_to_gguf writes it where the config has one (not Qwen2-MoE)
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if arch == "gemma3":
        full = rope.get("full_attention", rope)
        writer.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if c.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        writer.add_sliding_window(c["sliding_window"])
        return
    writer.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_count(c.get("num_experts") or c["num_local_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


def _add(writer: GGUFWriter, name: str, w: np.ndarray, type_name: str) -> np.ndarray:
    """Write w (float32) as type_name (1-D tensors and F32: float32); return the values the
    file holds, as float32."""
    if w.ndim == 1 or type_name == "F32":
        writer.add_tensor(name, w.astype(np.float32))
        return w.astype(np.float32)
    if type_name == "F16":
        writer.add_tensor(name, w.astype(np.float16))
        return w.astype(np.float16).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    q = quantize(np.ascontiguousarray(w), qtype)
    writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    return dequantize(q, qtype).reshape(w.shape).astype(np.float32)


def write_llama_cpp_gguf(hf_dir: Path, path: Path, type_name: str = "F32") -> dict:
    """hf_dir (a tiny qwen3_moe, qwen2_moe, gemma3_text or phi3 model) as a GGUF file the way llama.cpp's
    converter writes it: its architecture's metadata, names and layouts (stacked experts
    [E, rows, cols], Gemma's norms plus one, Phi-3's rope factors), the tokenizer as a gpt2
    vocabulary, every 2-D weight but the router in type_name (F32, F16, Q8_0). Returns the HF
    state dict of the values the file holds (the weights rounded as stored)."""
    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = LLAMA_CPP_ARCHS[config["model_type"]]
    state = {n: t.float().numpy() for n, t in load_file(str(hf_dir / "model.safetensors")).items()}
    writer = GGUFWriter(str(path), arch)
    _hparams(writer, arch, config)
    _tokenizer_metadata(writer, hf_dir)
    names = {**_COMMON, **_ARCH_NAMES.get(arch, {})}
    held: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, str]] = {}  # (layer, proj) -> {expert: HF name}
    for name, w in state.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            gguf_name = "token_embd.weight" if "embed" in name else "output.weight"
            held[name] = _add(writer, gguf_name, w, type_name)
            continue
        if name == "model.norm.weight":
            held[name] = w
            writer.add_tensor("output_norm.weight", (w + 1) if arch == "gemma3" else w)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.endswith(".bias"):  # Qwen2's q/k/v biases: float32
            held[name] = w
            writer.add_tensor(f"blk.{layer}.{names[rest.removesuffix('.bias')]}.bias", w)
            continue
        module = rest.removesuffix(".weight")
        if ".experts." in module:  # mlp.experts.E.proj: stacked below
            _, _, e, proj = module.split(".")
            experts.setdefault((layer, proj), {})[int(e)] = name
            continue
        gguf_name = f"blk.{layer}.{names[module]}.weight"
        if module.endswith("norm") or module.endswith("layernorm"):
            held[name] = w
            writer.add_tensor(gguf_name, (w + 1) if arch == "gemma3" else w)
        elif module in ("mlp.gate", "mlp.shared_expert_gate"):  # routers: llama.cpp keeps F32
            held[name] = _add(writer, gguf_name, w, "F32")
        else:
            held[name] = _add(writer, gguf_name, w, type_name)
    for (layer, proj), by_expert in experts.items():
        hf_names = [by_expert[e] for e in sorted(by_expert)]
        stacked = np.stack([state[n] for n in hf_names])  # [E, rows, cols]
        values = _add(writer, f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight",
                      stacked, type_name)  # fmt: skip
        for e, n in enumerate(hf_names):
            held[n] = values[e]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def save_as_hf(hf_dir: Path, dest: Path, state: dict) -> Path:
    """A copy of hf_dir whose weights are state (write_llama_cpp_gguf's values)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    shutil.copytree(hf_dir, dest)
    tensors = {n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in state.items()}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


# -- gpt-oss as llama.cpp's GptOssModel writes it --------------------------------------------

_GPT_OSS_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{f"self_attn.{p}_proj.{t}": f"attn_{g}.{t}" for p, g in
       (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for t in ("weight", "bias")},
}  # fmt: skip


def write_gpt_oss_gguf(
    hf_dir: Path,
    path: Path,
    experts: str = "MXFP4",
    type_name: str = "F32",
    pre: str = "default",
    control: tuple[str, ...] = (),
) -> dict:
    """A tiny gpt-oss HF model (float) as a llama.cpp gpt-oss GGUF: its metadata (yarn, window,
    expert counts and width), the attention and embeddings in type_name, the experts split
    into ffn_gate_exps / ffn_up_exps (gate_up's interleaved rows taken apart, as its biases)
    and ffn_down_exps, [E, rows, cols], in `experts` (MXFP4: gguf-py's quantizer, ggml's
    block_mxfp4). Returns the HF state dict of the values the file holds."""
    hf_dir = Path(hf_dir)
    c = json.loads((hf_dir / "config.json").read_text())
    state = {n: t.float().numpy() for n, t in load_file(str(hf_dir / "model.safetensors")).items()}
    writer = GGUFWriter(str(path), "gpt-oss")
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_expert_count(c["num_local_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_sliding_window(c["sliding_window"])
    writer.add_expert_feed_forward_length(c["intermediate_size"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _tokenizer_metadata(writer, hf_dir, pre, control)
    held: dict[str, np.ndarray] = {}
    for name, w in state.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            gguf_name = "token_embd.weight" if "embed" in name else "output.weight"
            held[name] = _add(writer, gguf_name, w, type_name)
            continue
        if name == "model.norm.weight":
            held[name] = _add(writer, "output_norm.weight", w, "F32")
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] (x @ W), gate and up interleaved
            rows = w.transpose(0, 2, 1)
            gate = _add(writer, f"{blk}.ffn_gate_exps.weight", rows[:, 0::2], experts)
            up = _add(writer, f"{blk}.ffn_up_exps.weight", rows[:, 1::2], experts)
            both = np.empty_like(rows)
            both[:, 0::2], both[:, 1::2] = gate, up
            held[name] = both.transpose(0, 2, 1)
        elif rest == "mlp.experts.gate_up_proj_bias":
            _add(writer, f"{blk}.ffn_gate_exps.bias", w[:, 0::2], "F32")
            _add(writer, f"{blk}.ffn_up_exps.bias", w[:, 1::2], "F32")
            held[name] = w
        elif rest == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            down = _add(writer, f"{blk}.ffn_down_exps.weight", w.transpose(0, 2, 1), experts)
            held[name] = down.transpose(0, 2, 1)
        elif rest == "mlp.experts.down_proj_bias":
            held[name] = _add(writer, f"{blk}.ffn_down_exps.bias", w, "F32")
        else:
            part = _GPT_OSS_NAMES[rest]
            kind = type_name if part.startswith("attn_") and part.endswith("weight") else "F32"
            held[name] = _add(writer, f"{blk}.{part}", w, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
