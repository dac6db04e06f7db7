"""The async engine (the server's EngineClient): an EngineRequest carries its adapter through
the engine's thread; a bad one is refused at the caller, before anything is queued."""

from __future__ import annotations

import asyncio

import pytest

from engine import CacheConfig, EngineConfig, LoRARequest, ModelConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import LoRAConfig, SchedulerConfig
from engine.protocol import EngineRequest
from tests.engine.lora.lora_testing import make_adapter, merged_greedy


async def test_async_engine_serves_adapters(tiny_llama_dir, tmp_path):
    adapters = [
        make_adapter(tiny_llama_dir, tmp_path / "x", r=8, seed=31),
        make_adapter(tiny_llama_dir, tmp_path / "y", r=4, targets=["q_proj", "down_proj"], seed=32),
    ]
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=256),
        lora=LoRAConfig(enabled=True, max_loras=2),
    )
    engine = await AsyncEngine.create(config)
    prompts = [[5, 9, 23, 7, 61], [8, 3, 44, 12], [70, 2, 2, 19, 33, 4]]
    loras = [LoRARequest("x", 1, str(adapters[0])), None, LoRARequest("y", 2, str(adapters[1]))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def one(i):
        last = None
        request = EngineRequest(f"r{i}", prompts[i], params, adapter=loras[i])
        async for out in engine.generate(request):
            last = out
        return last.outputs[0].token_ids

    try:
        got = await asyncio.gather(*(one(i) for i in range(3)))
        bad = LoRARequest("z", 3, str(tmp_path / "missing"))
        with pytest.raises(ValueError, match="lora_path"):
            await anext(engine.generate(EngineRequest("bad", prompts[0], params, adapter=bad)))
    finally:
        await engine.shutdown()
    dirs = [adapters[0], None, adapters[1]]
    want = [merged_greedy(tiny_llama_dir, d, [p], 6)[0] for d, p in zip(dirs, prompts, strict=True)]
    assert got == want
