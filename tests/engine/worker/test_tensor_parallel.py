"""Tensor parallelism inside the layers: 2 gloo ranks give the same logits as one process,
dense models and mixtures of experts."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.attention.backends.torch import TorchAttentionBackend
from engine.attention.metadata import common_metadata_from_seqs
from engine.models.loader import load_model

pytestmark = pytest.mark.slow

BLOCK = 8
# A prefill of 11 tokens into blocks [5, 2], then a decode of a 12th token.
PROMPT = [7, 99, 250, 3, 18, 41, 300, 5, 120, 64, 11]


def _logits(model_dir, kv_int8: bool = False) -> torch.Tensor:
    model = load_model(model_dir, dtype="float32")
    cfg = model.config
    from engine.attention.kv_int8 import Int8KVCacheSpec, allocate_scales
    from engine.distributed import get_tp_size

    hkv = cfg.num_key_value_heads // get_tp_size()
    for attn in model.attention_layers():
        dtype = torch.int8 if kv_int8 else torch.float32
        attn.kv_cache = torch.zeros(2, 8, BLOCK, hkv, cfg.head_dim, dtype=dtype)
        attn.kv_scales = allocate_scales(8, BLOCK, hkv, "cpu") if kv_int8 else None
        attn.kv_spec = Int8KVCacheSpec(BLOCK, hkv, cfg.head_dim, torch.float32) if kv_int8 else None
    heads = cfg.num_attention_heads // get_tp_size()
    backend = TorchAttentionBackend(BLOCK, heads, hkv, cfg.head_dim, torch.float32)
    for attn in model.attention_layers():
        attn.backend = backend
    with torch.inference_mode():
        meta = backend.build_metadata(common_metadata_from_seqs([(0, len(PROMPT), [5, 2])], BLOCK))
        a = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta))
        meta = backend.build_metadata(common_metadata_from_seqs([(len(PROMPT), 1, [5, 2])], BLOCK))
        b = model.compute_logits(model(torch.tensor([42]), torch.tensor([len(PROMPT)]), meta))
    return torch.cat([a, b])


def _worker(rank: int, port: int, model_dirs: list, out_file: str) -> None:
    from engine.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        results = [_logits(d) for d in model_dirs] + [_logits(model_dirs[0], kv_int8=True)]
        if rank == 0:
            torch.save(results, out_file)
    finally:
        destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_matches_tp1(
    tiny_llama_dir,
    tiny_qwen2_dir,
    tiny_mixtral_dir,
    tiny_qwen2_moe_dir,
    tiny_qwen3_moe_dir,
    make_tiny_model,
    tmp_path,
):
    torch.set_num_threads(1)
    # Odd vocab (a padded last shard) and biases on every projection (row-parallel bias).
    odd = make_tiny_model(
        "tiny-llama-odd-vocab", vocab_size=387, attention_bias=True, mlp_bias=True, seed=3
    )
    # The mixtures of experts: every expert split on its intermediate size (w13 column-wise,
    # w2 row-wise, one all-reduce after); Qwen2-MoE's shared expert as the dense MLP.
    moe = [tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_qwen3_moe_dir]
    dirs = [tiny_llama_dir, tiny_qwen2_dir, odd, *moe]
    # and an int8 KV cache: each rank quantizes its own heads, each head on its own
    expected = [_logits(d) for d in dirs] + [_logits(tiny_llama_dir, kv_int8=True)]
    out = tmp_path / "tp2.pt"
    mp.spawn(_worker, args=(_free_port(), dirs, str(out)), nprocs=2, join=True)
    for got, want in zip(torch.load(out), expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _generate(model_dir, tp: int, prompts, params, **extra) -> list[list[list[int]]]:
    from engine import LLM

    # A small pool and budget: chunked prefill and preemption on both sides.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_kv_blocks=24,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        tensor_parallel_size=tp,
        device="cpu",
        **extra,
    )
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        preempted = llm.engine.scheduler.stats().num_preemptions
        spec = llm.engine.scheduler.stats().spec_decoding
        if spec is not None:
            assert spec.num_accepted_tokens > 0
    finally:
        llm.shutdown()
    return [[c.token_ids for c in o.outputs] for o in outs], preempted


def test_tp2_engine_greedy_equals_tp1(tiny_llama_dir):
    """The whole engine over the worker channel: the worker rank learns every token from the
    incremental step payloads (new requests once, the driver's samples a step later)."""
    from engine import SamplingParams

    torch.set_num_threads(1)
    prompts = [list(range(10, 60)), list(range(100, 137)), [3, 9, 27, 81], list(range(200, 219))]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(n=2, max_tokens=30, temperature=0.0, ignore_eos=True)
    want, preempted = _generate(tiny_llama_dir, 1, prompts, params)
    got, _ = _generate(tiny_llama_dir, 2, prompts, params)
    assert preempted > 0
    assert got == want


def test_tp2_speculative_greedy_equals_tp1(tiny_llama_dir):
    """n-gram speculation at TP=2: the drafts travel in the step payload, both ranks compute
    the verification rows' logits, and the driver's kept tokens reach the worker a step later."""
    from engine import SamplingParams

    torch.set_num_threads(1)
    unit = list(range(30, 41))
    prompts = [unit * 3 + unit[:3], list(range(100, 137)), [7, 8, 9] * 6]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for _ in prompts]
    want, _ = _generate(tiny_llama_dir, 1, prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec["adaptive"] = False  # drafts at every step: accepted drafts are checked
    got, _ = _generate(tiny_llama_dir, 2, prompts, params, speculative_config=spec)
    assert got == want
