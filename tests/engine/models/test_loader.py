"""Loader: safetensors round trip, sharded checkpoints, dummy weights, config parsing, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import DEFAULT_MODEL
from engine.models.hf_config import load_hf_config, max_model_len_for, parse_hf_config
from engine.models.loader import load_model, resolve_dtype, resolve_model


def _hf_state(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_safetensors_round_trip(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype="float32")
    sd = _hf_state(tiny_llama_dir)
    ours = dict(model.named_parameters())
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(ours[p + "self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        assert torch.equal(ours[p + "mlp.gate_up_proj.weight"], gate_up)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(ours[p + name], sd[p + name])
    assert torch.equal(ours["lm_head.weight"], sd["lm_head.weight"])
    assert torch.equal(ours["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])


def test_tied_embeddings_and_qkv_bias(tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir, dtype="float32")
    sd = _hf_state(tiny_qwen2_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    expect = torch.cat([sd[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(bias, expect)
    assert model.model.layers[0].self_attn.o_proj.bias is None


def test_sharded_checkpoint_with_index(tiny_llama_dir, tmp_path):
    from safetensors.torch import save_file

    sd = _hf_state(tiny_llama_dir)
    names = sorted(sd)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in halves.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    a = load_model(tiny_llama_dir, dtype="float32").state_dict()
    b = load_model(tmp_path, dtype="float32").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_weight_is_reported(tiny_llama_dir, tmp_path):
    from safetensors.torch import save_file

    sd = _hf_state(tiny_llama_dir)
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj"):
        load_model(tmp_path, dtype="float32")


def test_dummy_load_needs_only_config(tiny_llama_dir, tmp_path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    a = load_model(tmp_path, dtype="bfloat16", load_format="dummy", seed=3)
    b = load_model(tmp_path, dtype="bfloat16", load_format="dummy", seed=3)
    w = a.model.layers[0].self_attn.qkv_proj.weight
    assert w.dtype == torch.bfloat16 and w.shape == (8 * 16, 64)
    assert 0.01 < w.float().std() < 0.03
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_unknown_architecture_names_supported_ones(tiny_llama_dir, tmp_path):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"'GPT2LMHeadModel' is not supported.*LlamaForCausalLM.*Qwen2ForCausalLM"
    ):
        load_model(tmp_path, load_format="dummy")


def test_resolve_model_paths(tiny_llama_dir, tmp_path):
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir
    with pytest.raises(ValueError, match=f"not found.*{DEFAULT_MODEL}"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


def test_auto_dtype(tiny_llama_dir):
    cfg = load_hf_config(tiny_llama_dir)
    assert resolve_dtype("auto", cfg) == torch.float32  # the checkpoint says float32
    cfg.dtype = "bfloat16"
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    cfg.dtype = "float16"
    assert resolve_dtype("auto", cfg) == torch.bfloat16  # on CPU
    assert resolve_dtype("float16", cfg) == torch.float16


_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
}


def test_config_old_rope_format_and_generation_eos():
    raw = {
        **_BASE,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": 128001,
    }
    cfg = parse_hf_config(raw, {"eos_token_id": [128001, 128009]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_ids == [128001, 128009]
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16
    assert parse_hf_config({**_BASE, "rope_scaling": {"type": "default"}}).rope_scaling is None


def test_sliding_window_models_keep_their_whole_context_and_a_window_per_layer():
    """A sliding-window model serves max_position_embeddings (its layers attend within their
    windows); each layer's window follows transformers' rule for the model."""
    mistral = parse_hf_config(
        {**_BASE, "model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}
    )
    assert max_model_len_for(mistral, None) == 32768
    assert max_model_len_for(mistral, 8192) == 8192
    with pytest.raises(ValueError, match="max_position_embeddings.*at most 32768"):
        max_model_len_for(mistral, 40000)
    n = mistral.num_hidden_layers
    assert mistral.layer_sliding_windows == [4096] * n and mistral.kv_sliding_window() == 4096
    # Qwen2 carries a window it does not use unless use_sliding_window is set.
    qwen = parse_hf_config(
        {**_BASE, "model_type": "qwen2", "max_position_embeddings": 32768, "sliding_window": 4096}
    )
    assert max_model_len_for(qwen, None) == 32768 and qwen.attention_bias
    assert qwen.layer_sliding_windows == [] and qwen.sliding_window is None
    assert qwen.kv_sliding_window() is None and qwen.layer_sliding_window(0) is None
    # With it: layers >= max_window_layers (a hybrid model: the cache keeps every block)...
    qwen_sw = {**_BASE, "model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 64}
    qwen_sw |= {"use_sliding_window": True, "max_window_layers": 2}
    hybrid = parse_hf_config(qwen_sw)
    assert hybrid.layer_sliding_windows == [None, None, 64, 64] and hybrid.sliding_window == 64
    assert hybrid.kv_sliding_window() is None
    # ...or every layer from 0; layer_types, where the file has them, decide.
    assert parse_hf_config({**qwen_sw, "max_window_layers": 0}).kv_sliding_window() == 64
    types = ["sliding_attention", "full_attention"] * 2
    assert parse_hf_config({**qwen_sw, "layer_types": types}).layer_sliding_windows == [
        64, None, 64, None,
    ]  # fmt: skip
    moe = parse_hf_config({**qwen_sw, "model_type": "qwen2_moe", "max_window_layers": 3})
    assert moe.layer_sliding_windows == [64, None, 64, None]  # even layers below 3
    moe3 = parse_hf_config({**qwen_sw, "model_type": "qwen3_moe"})
    assert moe3.layer_sliding_windows == [64] * 4  # every layer, whatever max_window_layers
    gemma_like = {**_BASE, "num_hidden_layers": 4, "sliding_window": 8, "layer_types": types}
    assert parse_hf_config(gemma_like).layer_sliding_windows == [8, None, 8, None]
    assert parse_hf_config(_BASE).layer_sliding_windows == []


def test_dummy_serves_from_a_folder_without_weights(tiny_llama_dir, tmp_path):
    """--load-format dummy needs config.json only: resolve_model and the whole engine."""
    from engine import LLM, SamplingParams

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    assert resolve_model(str(tmp_path), load_format="dummy") == tmp_path
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        tokenizer=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=16,
        max_model_len=64,
        device="cpu",
    )
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.cuda
def test_dummy_weights_are_drawn_on_the_gpu(tiny_llama_dir):
    """Nothing of the dummy init runs on the host: every op it dispatches is on CUDA."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.models import loader

    class HostOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [*args, *(kwargs or {}).values()]
            if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in flat):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model = load_model(tiny_llama_dir, dtype="bfloat16", load_format="dummy", device="cuda")
    with HostOps() as host:
        loader._init_dummy(model, seed=1)
    assert host.seen == []
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert w.device.type == "cuda" and 0.01 < w.float().std().item() < 0.03


def test_moe_experts_stacked_from_per_expert_tensors(tiny_mixtral_dir, tiny_qwen2_moe_dir):
    """Mixtral's block_sparse_moe.experts.E.w1/w3/w2 and Qwen's experts.E.gate/up/down_proj
    land in w13 [E, 2I, H] (gate | up) and w2 [E, H, I]; routers and the shared expert too."""
    for model_dir, (gate, up, down), block in (
        (tiny_mixtral_dir, ("w1", "w3", "w2"), "block_sparse_moe"),
        (tiny_qwen2_moe_dir, ("gate_proj", "up_proj", "down_proj"), "mlp"),
    ):
        model = load_model(model_dir, dtype="float32")
        sd = _hf_state(model_dir)
        for i, layer in enumerate(model.model.layers):
            p = f"model.layers.{i}.{block}."
            moe = layer.mlp
            assert torch.equal(moe.gate.weight, sd[p + "gate.weight"])
            for e in range(model.config.num_experts):
                x = f"{p}experts.{e}."
                want = torch.cat([sd[x + f"{gate}.weight"], sd[x + f"{up}.weight"]])
                assert torch.equal(moe.experts.w13_weight[e], want)
                assert torch.equal(moe.experts.w2_weight[e], sd[x + f"{down}.weight"])
            if block == "mlp":
                assert torch.equal(
                    moe.shared_expert_gate.weight, sd[p + "shared_expert_gate.weight"]
                )
                assert torch.equal(
                    moe.shared_expert.down_proj.weight, sd[p + "shared_expert.down_proj.weight"]
                )


def test_missing_expert_weight_is_reported(tiny_qwen3_moe_dir, tmp_path):
    from safetensors.torch import save_file

    sd = _hf_state(tiny_qwen3_moe_dir)
    del sd["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_qwen3_moe_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"missing.*layers\.2\.mlp\.experts\.w13_weight"):
        load_model(tmp_path, dtype="float32")


def test_moe_dummy_load(tiny_mixtral_dir, tmp_path):
    shutil.copy(tiny_mixtral_dir / "config.json", tmp_path / "config.json")
    model = load_model(tmp_path, dtype="bfloat16", load_format="dummy", seed=3)
    w13 = model.model.layers[0].mlp.experts.w13_weight
    assert w13.shape == (8, 64, 64) and 0.01 < w13.float().std() < 0.03
