"""Model-based speculation with a tensor-parallel target (TP=2 on the CPU, worker processes):
the draft model or head runs whole on the driver, its drafts go to every rank in the step
payload. Greedy output token for token the same as the same TP=2 engine without drafts, under
preemption, chunked prefill and prefix hits; drafts accepted where the draft mirrors the
target (the target as its own draft; EAGLE-1 and EAGLE-3 heads built to mirror it), which a
draft reading wrongly gathered embedding or LM-head shards would not be."""

from __future__ import annotations

import json

import pytest
import torch
from eagle_heads import eagle3_head, one_layer_in_effect
from test_eagle import _head as eagle1_head
from test_eagle import target_dir as eagle1_target  # noqa: F401 (a fixture)

from engine import LLM, SamplingParams

TIGHT = {"num_kv_blocks": 9, "max_model_len": 128, "max_num_batched_tokens": 32}


def _run(target_dir, spec, first: int = 8):
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, vocab, (first + 6 * i,), generator=g).tolist() for i in range(4)]
    waves = [prompts, [p + [7] for p in prompts[1:]]]  # the second wave hits cached blocks
    # drafts at every step: the drafting itself is under test (the controller: test_controller.py)
    spec = {**spec, "adaptive": False} if spec else None
    llm = LLM(
        str(target_dir),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        speculative_config=spec,
        **TIGHT,
    )
    try:
        outs = []
        for wave in waves:
            params = [
                SamplingParams(max_tokens=14 + 2 * i, temperature=0.0, ignore_eos=True)
                for i in range(len(wave))
            ]
            outs += [o.outputs[0].token_ids for o in llm.generate(wave, params, use_tqdm=False)]
        scheduler = llm.engine.scheduler
        assert scheduler.kv_cache_manager.prefix_cache_hits > 0
        assert len({t for o in outs for t in o}) > 8, "a degenerate target proves nothing"
        leaked = llm.engine.num_blocks - 1 - scheduler.kv_cache_manager.num_free_blocks
        assert leaked == 0
        return outs, scheduler.stats().spec_decoding, scheduler.num_preemptions
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def mirror_target(tiny_llama_dir, tmp_path_factory):
    return one_layer_in_effect(tiny_llama_dir, tmp_path_factory.mktemp("tp-eagle3-target") / "m")


def test_draft_model_and_eagle3_at_tp2(mirror_target, tmp_path):
    """The draft model whole on the driver and split over the ranks, and an EAGLE-3 head."""
    ref, _, preempted = _run(mirror_target, None, first=24)
    assert preempted > 0
    spec = {"model": str(mirror_target), "num_speculative_tokens": 3, "draft_backoff": False}
    got, stats, _ = _run(mirror_target, spec, first=24)
    assert got == ref
    # the target as its own draft (whole, on the driver): only rounding tells them apart
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    # draft_tensor_parallel_size 2: every rank holds half the draft (and of its KV cache) and
    # runs the step's draft forwards from the driver's plan; its drafts kept as when whole
    got, stats, _ = _run(mirror_target, {**spec, "draft_tensor_parallel_size": 2}, first=24)
    assert got == ref
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens, stats
    head = eagle3_head(mirror_target, tmp_path / "eagle3", mirror=True)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    got, stats, _ = _run(mirror_target, {**spec, "draft_backoff": False}, first=24)
    assert got == ref
    # (test_eagle3's mirror bound: the target's layer on the context less its first token)
    assert stats.accepted_per_pos[0] > 0.5 * stats.num_drafts, stats


def test_eagle1_at_tp2(eagle1_target, tmp_path):  # noqa: F811
    ref, _, _ = _run(eagle1_target, None)
    head = eagle1_head(eagle1_target, tmp_path / "eagle1", mirror=True)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    got, stats, _ = _run(eagle1_target, spec)
    assert got == ref
    # the head reads the target's embedding and LM head whole, gathered from both ranks
    assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens, stats


def test_kv_budget_counts_the_draft_on_the_driver_only(tiny_llama_dir, make_tiny_model):
    """The driver holds the draft's KV cache beside its shard of the target's, the worker
    only its shard: the engine takes the driver's (smaller) block count."""
    draft = make_tiny_model(  # test_draft_model's draft: 1 layer, 1 KV head of 16
        "tiny-llama-draft",
        seed=7,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    budget = 4 << 20
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        kv_cache_memory=budget,
        speculative_config={"model": str(draft)},
    )
    try:
        runner = llm.engine.executor.runner
        layer = runner.kv_cache_spec().bytes_per_block  # this rank's 1 of 2 KV heads x 16
        assert runner.drafter.kv_block_bytes() == layer  # the draft's 1 KV head, whole
        assert llm.engine.num_blocks == budget // (3 * layer + layer)
        assert runner.drafter.kv_caches[0].shape[1] == llm.engine.num_blocks
    finally:
        llm.shutdown()
