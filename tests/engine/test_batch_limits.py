"""engine.batch_limits: the default max_num_seqs / max_num_batched_tokens as a pure function of
the device type, its memory and the model's shape (vLLM's classes: 1024 / 8192 on GPUs of 70
GiB and more, 256 / 2048 below), the CPU's defaults unchanged, given values kept, and the
start-up log line that says what was chosen."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from engine.args import EngineArgs, default_max_num_batched_tokens
from engine.batch_limits import (
    GiB,
    ModelShape,
    apply_to_config,
    default_batch_limits,
    model_shape,
)
from engine.models.hf_config import load_hf_config

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# 32 x (2 x 4096 x 4096 + 2 x 4096 x 1024 + 3 x 4096 x 14336) + 2 x 128256 x 4096, bf16
LLAMA3_8B_WEIGHT_BYTES = 2 * (32 * 218_103_808 + 2 * 525_336_576)
LLAMA3_8B_SHAPE = ModelShape(32, 4096, 131_072, LLAMA3_8B_WEIGHT_BYTES)
LLAMA3_70B_SHAPE = ModelShape(80, 8192, 327_680, 141_100_000_000)
H100 = int(79.2 * GiB)  # what the driver reports of an 80 GB H100
H200 = int(139.8 * GiB)
L4 = int(22.5 * GiB)


def limits(device, memory, shape):
    got = default_batch_limits(device, memory, shape)
    return got.max_num_seqs, got.max_num_batched_tokens


@pytest.mark.parametrize("memory", [None, 8 * GiB, H100])
@pytest.mark.parametrize("shape", [None, LLAMA3_8B_SHAPE, LLAMA3_70B_SHAPE])
def test_cpu_defaults_are_unchanged_whatever_the_memory_and_model(memory, shape):
    assert limits("cpu", memory, shape) == (256, 1024)


def test_large_gpus_take_vllms_api_server_class_where_the_model_leaves_room():
    assert limits("cuda", H100, LLAMA3_8B_SHAPE) == (1024, 8192)
    assert limits("cuda", H200, LLAMA3_8B_SHAPE) == (1024, 8192)
    # a tiny model changes nothing: the class's limits are the most
    assert limits("cuda", H200, ModelShape(30, 576, 46_080, 270_000_000)) == (1024, 8192)


def test_smaller_gpus_and_unknown_memory_take_the_smaller_class():
    assert limits("cuda", None, None) == (256, 2048) == limits("cuda", 40 * GiB, None)
    assert default_max_num_batched_tokens("cuda") == 2048
    assert limits("cuda", 48 * GiB, ModelShape(30, 576, 46_080, 270_000_000)) == (256, 2048)


def test_seats_shrink_to_what_the_kv_cache_left_beside_the_weights_holds():
    # L4: 0.9 x 22.5 GiB - 16.1 GB of weights = 5.6 GB of KV = 167 seats of 256 tokens
    assert limits("cuda", L4, LLAMA3_8B_SHAPE) == (128, 2048)
    # Llama-3-70B in bf16 barely fits an H200: the fewest seats, the class's tokens
    assert limits("cuda", H200, LLAMA3_70B_SHAPE) == (16, 8192)
    # more memory never gives fewer seats
    seats = [limits("cuda", m * GiB, LLAMA3_8B_SHAPE)[0] for m in (20, 24, 40, 48, 80, 141)]
    assert seats == sorted(seats)


def test_tokens_follow_the_activation_room_but_never_drop_below_the_seats():
    wide = ModelShape(2, 16384, 1024, 1 << 30)  # 0.05 x 8 GiB of 16 x 16384 x 2 B rows
    assert limits("cuda", 8 * GiB, wide) == (256, 512)
    wider = ModelShape(2, 65536, 1024, 1 << 30)
    seqs, tokens = limits("cuda", 8 * GiB, wider)
    assert tokens == seqs == 256
    assert "raised to the seats" in default_batch_limits("cuda", 8 * GiB, wider).why


def test_unknown_weight_bytes_are_estimated_from_layers_and_hidden():
    assert ModelShape(32, 4096, 131_072).weights() == 24 * 32 * 4096**2
    # 0.9 x 20 GiB - 12.9 GB estimated = 192 seats of 256 tokens (576 with no weights)
    assert limits("cuda", 20 * GiB, ModelShape(32, 4096, 131_072)) == (128, 2048)


def _config_dir(tmp_path, config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_model_shape_from_a_checkpoint_config(tmp_path):
    hf = load_hf_config(_config_dir(tmp_path, LLAMA3_8B))
    assert model_shape(hf, 2, 2) == LLAMA3_8B_SHAPE
    fp8_kv_tp2 = model_shape(hf, 2, 1, tp=2)
    assert fp8_kv_tp2.kv_bytes_per_token == 131_072 // 4
    assert fp8_kv_tp2.weight_bytes == LLAMA3_8B_WEIGHT_BYTES // 2


def test_model_shape_counts_every_expert(tmp_path):
    mixtral = {
        **LLAMA3_8B,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    hf = load_hf_config(_config_dir(tmp_path, mixtral))
    dense = model_shape(load_hf_config(_config_dir(tmp_path / "d", LLAMA3_8B)), 2, 2)
    assert hf.num_experts == 8
    shape = model_shape(hf, 2, 2)
    mlp = 3 * 4096 * 14336
    # 7 more copies of the MLP and the router per layer; a smaller vocabulary
    extra = 32 * (7 * mlp + 4096 * 8) - 2 * (128256 - 32000) * 4096
    assert shape.weight_bytes - dense.weight_bytes == 2 * extra


def _fake_gpu(monkeypatch, memory):
    props = types.SimpleNamespace(total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return torch.device("cuda")


def test_the_engine_sizes_what_was_left_unset_on_a_gpu(tmp_path, monkeypatch):
    hf = load_hf_config(_config_dir(tmp_path, LLAMA3_8B))
    device = _fake_gpu(monkeypatch, L4)
    config = EngineArgs(model=str(tmp_path), device="cuda").create_engine_config()
    assert config.scheduler.sized_by_engine == ("max_num_seqs", "max_num_batched_tokens")
    line = apply_to_config(config, hf, device)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (128, 2048)
    assert line.startswith("max_num_seqs 128, max_num_batched_tokens 2048 (")
    assert "22 GiB" in line and "128 seats" in line

    given = EngineArgs(model=str(tmp_path), device="cuda", max_num_seqs=300)
    config = given.create_engine_config()
    assert config.scheduler.sized_by_engine == ("max_num_batched_tokens",)
    line = apply_to_config(config, hf, _fake_gpu(monkeypatch, H100))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (300, 8192)
    assert "max_num_seqs as given" in line

    small_steps = EngineArgs(model=str(tmp_path), device="cuda", max_num_batched_tokens=32)
    config = small_steps.create_engine_config()
    line = apply_to_config(config, hf, _fake_gpu(monkeypatch, H100))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (32, 32)
    assert "which caps the seats" in line


def test_cpu_configs_are_left_as_they_are(tmp_path):
    hf = load_hf_config(_config_dir(tmp_path, LLAMA3_8B))
    config = EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    assert config.scheduler.sized_by_engine == ()
    before = config.scheduler
    line = apply_to_config(config, hf, torch.device("cpu"))
    assert config.scheduler is before
    assert (before.max_num_seqs, before.max_num_batched_tokens) == (256, 1024)
    assert line == (
        "max_num_seqs 256, max_num_batched_tokens 1024 (the CPU defaults where not given)"
    )
    given = EngineArgs(model=str(tmp_path), device="cpu", max_num_seqs=7).create_engine_config()
    assert given.scheduler.max_num_seqs == 7


def test_the_start_up_log_line_names_the_limits(tiny_llama_dir, caplog):
    from engine import LLM

    with caplog.at_level(logging.INFO, logger="tessera.engine"):
        llm = LLM(str(tiny_llama_dir), device="cpu", max_num_seqs=5)
    try:
        ready = [r.getMessage() for r in caplog.records if "Engine ready" in r.getMessage()]
        assert len(ready) == 1
        assert "max_num_seqs 5, max_num_batched_tokens 1024" in ready[0]
    finally:
        llm.shutdown()
