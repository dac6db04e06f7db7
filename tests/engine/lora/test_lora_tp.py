"""LoRA under tensor parallelism (2 gloo ranks on the CPU): column-parallel layers split B on
the output, row-parallel ones A on the input (the base all-reduce sums the partial deltas);
the adapter travels to the worker rank inside NewRequestData. Greedy tokens equal HF + peft's
merged model."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from tests.engine.lora.lora_testing import make_adapter, merged_greedy

pytestmark = pytest.mark.slow


def test_tp2_mixed_batch_matches_merged_models(tiny_llama_dir, tmp_path):
    torch.set_num_threads(1)
    adapters = [
        make_adapter(tiny_llama_dir, tmp_path / "all", r=8, alpha=16, seed=21),
        make_adapter(tiny_llama_dir, tmp_path / "ov", r=16, alpha=16, targets=["o_proj", "v_proj", "down_proj"], seed=22),
    ]  # fmt: skip
    prompts = [list(range(10, 41)), list(range(100, 117)), [3, 9, 27, 81], list(range(200, 219))]
    assign = [0, 1, None, 1]
    want = [
        merged_greedy(tiny_llama_dir, None if a is None else adapters[a], [p], 8)[0]
        for p, a in zip(prompts, assign, strict=True)
    ]
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        tensor_parallel_size=2,
        device="cpu",
        enable_lora=True,
        max_loras=2,
    )
    try:
        loras = [
            None if a is None else LoRARequest(f"a{a}", a + 1, str(adapters[a])) for a in assign
        ]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
