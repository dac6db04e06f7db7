"""EngineArgs: each engine option written once reaches the config, the LLM keywords, the
`tessera serve` flags and the TESSERA_* variables."""

from __future__ import annotations

import dataclasses

import pytest

from api.server.settings import Settings
from engine.args import EngineArgs
from engine.llm import LLM

# A valid value other than the default for every option: each must change the config.
OTHER_VALUES = {
    "model": "some-model",
    "served_model_name": "served",
    "tokenizer": "/tok",
    "dtype": "float32",
    "load_format": "dummy",
    "quantization": "int8",
    "device": "cpu",
    "runner": "pooling",
    "attention_backend": "torch",
    "enforce_eager": True,
    "cudagraph_mode": "full_decode_only",
    "seed": 7,
    "reasoning_parser": "qwen3",
    "generation_config": "vllm",
    "chat_template": "{{ messages }}",
    "max_model_len": 512,
    "max_num_seqs": 3,
    "max_num_batched_tokens": 640,
    "stream_interval": 4,
    "max_num_queued_requests": 9,
    "scheduling_policy": "priority",
    "enable_chunked_prefill": False,
    "async_scheduling": False,
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
    "block_size": 32,
    "num_kv_blocks": 77,
    "kv_cache_memory": 1 << 20,
    "kv_cache_dtype": "int8",
    "gpu_memory_utilization": 0.5,
    "enable_prefix_caching": False,
    "enable_lora": True,
    "max_loras": 4,
    "max_lora_rank": 64,
    "max_cpu_loras": 8,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "enable_expert_parallel": True,
    "distributed_executor_backend": "ray",
    "collective_timeout": 12.0,
    "frontend_threads": 1,
}


def _names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_every_option_has_a_test_value():
    assert sorted(OTHER_VALUES) == sorted(_names(EngineArgs))


@pytest.mark.parametrize("name", sorted(OTHER_VALUES))
def test_every_option_reaches_the_engine_config(name):
    """No option is dropped on the way: changing it alone changes the config."""
    # chunked prefill off needs a step budget of the whole context
    base = dict(device="cpu", max_num_batched_tokens=2048, max_model_len=1024)
    base.pop(name, None)
    default = EngineArgs(**base).create_engine_config()
    changed = EngineArgs(**base, **{name: OTHER_VALUES[name]}).create_engine_config()
    assert changed != default


def test_serve_flags_and_variables_are_generated_from_the_same_fields():
    """Settings is EngineArgs plus the server's options: every engine option is a flag and a
    variable with the help written in EngineArgs."""
    engine_fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    settings_fields = {f.name: f for f in dataclasses.fields(Settings)}
    for name, f in engine_fields.items():
        assert settings_fields[name].metadata["help"] == f.metadata["help"]
    flags = ["--num-kv-blocks", "77", "--collective-timeout", "12", "--no-enable-chunked-prefill"]
    s = Settings.from_argv(flags, {"TESSERA_SCHEDULING_POLICY": "priority"})
    c = s.create_engine_config()
    assert c.cache.num_blocks == 77 and c.parallel.collective_timeout_s == 12.0
    assert c.scheduler.enable_chunked_prefill is False and c.scheduler.policy == "priority"


def test_serving_defaults_differ_where_the_server_needs_them():
    offline, serving = EngineArgs(), Settings()
    assert offline.max_num_queued_requests is None and serving.max_num_queued_requests == 1024
    assert offline.frontend_threads == 0 and serving.frontend_threads is None  # measured
    assert offline.create_engine_config().scheduler.policy == "fcfs"
    assert serving.create_engine_config().scheduler.policy == "fair"  # keys tell tenants apart
    assert Settings(auth="none").create_engine_config().scheduler.policy == "fcfs"


def test_llm_names_the_options_it_takes():
    with pytest.raises(TypeError, match="num_kv_blocks"):
        LLM(num_blocks=8)


def test_bad_values_are_refused_by_the_config():
    with pytest.raises(ValueError, match="max_num_queued_requests"):
        EngineArgs(max_num_queued_requests=-1).create_engine_config()
    with pytest.raises(ValueError, match="frontend_threads"):
        EngineArgs(frontend_threads=-1).create_engine_config()
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(enable_lora=True, max_lora_rank=0).create_engine_config()
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).create_engine_config()
