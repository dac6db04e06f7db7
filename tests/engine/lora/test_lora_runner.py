"""The runner's side: a step with adapters runs eagerly (the step graph is not asked), a step
without runs the graph as before; a fused MLP path steps aside while a step adds deltas."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from engine.lora.request import LoRARequest
from engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner
from tests.engine.lora.lora_testing import make_adapter

BLOCK = 16


class _RecordingGraph:
    """A step graph that declines every step, counting the steps it was asked to take;
    takes_lora: whether it says it runs steps with adapters (the CPU decode plan does)."""

    eager_inputs = False
    graph_bytes = 0
    lora_blockers = frozenset({"dora"})

    def __init__(self, takes_lora: bool = False) -> None:
        self.asked = 0
        self.takes_lora = takes_lora

    def run(self, inputs):
        self.asked += 1
        return None

    def close(self) -> None:
        pass


def _step(rid, prompt, lora, block):
    new = NewRequestData(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0), [], None, lora)
    sr = ScheduledRequest(rid, 0, len(prompt), [block], True)
    return SchedulerOutput([sr], len(prompt), [new])


@pytest.mark.parametrize("takes_lora", [False, True])
def test_steps_with_adapters_skip_a_step_graph_without_lora(tiny_llama_dir, tmp_path, takes_lora):
    adapter = make_adapter(tiny_llama_dir, tmp_path / "a", r=8, targets=["q_proj", "gate_proj"])
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=40),
        scheduler=SchedulerConfig(block_size=BLOCK, max_model_len=512),
        lora=LoRAConfig(enabled=True, max_loras=1),
    )
    runner = ModelRunner(config, model_dir=tiny_llama_dir)
    runner.load_model()
    runner.init_kv_cache(40)
    graph = runner._step_graph = _RecordingGraph(takes_lora)
    lora = LoRARequest("a", 1, str(adapter))
    runner.execute_model(_step("r1", [5, 6, 7], lora, 1))
    assert graph.asked == int(takes_lora) and runner.lora_manager.batch.active
    runner.execute_model(_step("r2", [5, 6, 7], None, 2))
    assert graph.asked == 1 + int(takes_lora) and not runner.lora_manager.batch.active
    # the layers the adapter targets hold it in slot 0; the others hold nothing
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.lora.width == [8]
    assert layer.self_attn.o_proj.lora.width == [0]
    assert layer.mlp.gate_up_proj.lora.width == [8]


def test_the_fused_gated_mlp_steps_aside_for_deltas():
    from engine.layers.mlp import GatedMLP
    from engine.lora.layers import LoRABatch, LoRALayer

    torch.manual_seed(0)
    mlp = GatedMLP(16, 32)
    for p in mlp.parameters():
        p.data.normal_()
    calls = []

    def fused(gate_up, down, x):
        calls.append(1)
        return torch.zeros(x.shape[0], 16)

    mlp.gate_up_proj.quant_method.apply_gated_mlp = fused
    batch = LoRABatch(torch.device("cpu"))
    mlp.down_proj.lora = LoRALayer(batch, [(0, 16)], 32, 1, 4, torch.float32, torch.device("cpu"))
    mlp.down_proj.lora.set_slot(0, [(torch.randn(4, 32), torch.randn(16, 4))])
    x = torch.randn(3, 16)
    batch.set([(0, 0, 3)])
    with torch.inference_mode():
        y = mlp(x)
    assert not calls and y.abs().sum() > 0
    batch.clear()
    with torch.inference_mode():
        mlp(x)
    assert calls == [1]
