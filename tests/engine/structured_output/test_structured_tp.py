"""Structured output under tensor parallelism (2 gloo ranks on CPU): the driver fills and
applies the masks, the worker rank takes the same LM-head path (decided from the params it
also holds), and the tokens equal one process's, preemption and n=2 included."""

from __future__ import annotations

import json

import pytest
import torch
from structured_schemas import ALL

from engine import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow


def _generate(model_dir, tp: int, prompts, params):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_kv_blocks=18,  # 136 tokens for ~110 of prompts: preemption
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        tensor_parallel_size=tp,
        device="cpu",
    )
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        preempted = llm.engine.scheduler.stats().num_preemptions
    finally:
        llm.shutdown()
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs], preempted


def test_tp2_structured_equals_tp1(tiny_llama_dir):
    torch.set_num_threads(1)
    so = StructuredOutputsParams(json=ALL["optional"])
    prompts = [list(range(10, 60)), list(range(100, 137)), [3, 9, 27, 81], list(range(200, 219))]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),  # plain greedy
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, structured_outputs=so),
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            structured_outputs=StructuredOutputsParams(regex="[a-c]{3,9}"),
        ),
    ]
    want, _ = _generate(tiny_llama_dir, 1, prompts, params)
    got, preempted = _generate(tiny_llama_dir, 2, prompts, params)
    assert preempted > 0
    assert got == want
    for _, text, reason in want[1] + want[2]:
        if reason == "stop":
            json.loads(text)
