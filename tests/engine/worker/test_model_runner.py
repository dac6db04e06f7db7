"""ModelRunner: steps driven by hand-made SchedulerOutputs, checked against HF greedy output."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner

BLOCK = 8


def make_config(model_dir, num_blocks=64, max_model_len=128, kv_cache_memory=None, **model_kw):
    return EngineConfig(
        model=ModelConfig(
            model=str(model_dir), dtype="float32", max_model_len=max_model_len, **model_kw
        ),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory),
        scheduler=SchedulerConfig(block_size=BLOCK, max_model_len=max_model_len),
    )


@pytest.fixture
def runner(tiny_llama_dir):
    torch.set_num_threads(1)
    r = ModelRunner(make_config(tiny_llama_dir), model_dir=tiny_llama_dir)
    r.load_model()
    r.init_kv_cache(r.determine_num_blocks())
    return r


class Driver:
    """Plays the scheduler: shuffled block allocation, chunked prefill, then greedy decode.
    Like the scheduler, it sends a request whole once, then only each step's changes."""

    def __init__(self, runner, seed=0):
        self.runner = runner
        self.free = list(range(1, runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}  # tokens whose K/V are cached
        self.num_sent: dict[str, int] = {}  # block ids the runner has
        self.unsent: dict[str, NewRequestData] = {}

    def add(self, rid, prompt, params=None, outputs=()):
        self.tokens[rid], self.tables[rid], self.done[rid] = [*prompt, *outputs], [], 0
        self.unsent[rid] = NewRequestData(
            rid, list(prompt), params or SamplingParams(temperature=0.0), list(outputs)
        )
        self.num_sent[rid] = 0

    def chunk(self, rid, n):
        toks = self.tokens[rid]
        start = self.done[rid]
        end = min(start + n, len(toks))
        table = self.tables[rid]
        while len(table) * BLOCK < end:
            table.append(self.free.pop())
        new_blocks = table[self.num_sent[rid] :]
        self.num_sent[rid] = len(table)
        return ScheduledRequest(
            request_id=rid,
            start_pos=start,
            num_tokens=end - start,
            new_block_ids=new_blocks,
            sample=end == len(toks),
        )

    def step(self, chunks, **kw):
        new = [self.unsent.pop(c.request_id) for c in chunks if c.request_id in self.unsent]
        out = self.runner.execute_model(
            SchedulerOutput(
                scheduled=chunks,
                num_batched_tokens=sum(c.num_tokens for c in chunks),
                new_requests=new,
                **kw,
            )
        )
        for c in chunks:
            self.done[c.request_id] = c.start_pos + c.num_tokens
            self.tokens[c.request_id] += out.sampled_token_ids[c.request_id][:1]
            state = self.runner.input_batch[c.request_id]
            assert state.token_ids == self.tokens[c.request_id]  # the runner appends its own
            assert state.block_table.tolist() == self.tables[c.request_id]
        return out


def _hf_greedy(model_dir, prompt, n):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_chunked_prefill_and_decode_match_hf_greedy(runner, tiny_llama_dir):
    prompts = {"a": [5, 17, 200, 33, 41, 90, 7], "b": list(range(10, 40)), "c": [300, 4, 4, 250]}
    d = Driver(runner)
    for rid, p in prompts.items():
        d.add(rid, p)
    # Step 1: "a" whole, "b" a first chunk (no sample), "c" whole.
    out = d.step([d.chunk("a", 100), d.chunk("b", 12), d.chunk("c", 100)])
    assert out.sampled_token_ids["b"] == []
    assert len(out.sampled_token_ids["a"]) == 1 and len(out.sampled_token_ids["c"]) == 1
    # Step 2: decodes of a and c mixed with the rest of b's prompt; then decode all three.
    d.step([d.chunk("a", 1), d.chunk("b", 100), d.chunk("c", 1)])
    for _ in range(8):
        d.step([d.chunk(rid, 1) for rid in ("c", "b", "a")])  # any order: the runner sorts
    for rid, p in prompts.items():
        got = d.tokens[rid][len(p) :]
        assert got == _hf_greedy(tiny_llama_dir, p, len(got)), rid


def test_blocks_to_copy_copies_exactly(runner):
    g = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=g))
    before = [c.clone() for c in runner.kv_caches]
    # A chain: 5 -> 9 and 9 -> 12 both read the state before this step.
    out = runner.execute_model(
        SchedulerOutput(
            scheduled=[], num_batched_tokens=0, blocks_to_copy=[(3, 7), (5, 9), (9, 12)]
        )
    )
    assert out.sampled_token_ids == {}
    for old, new in zip(before, runner.kv_caches, strict=True):
        expect = old.clone()
        expect[:, 7], expect[:, 9], expect[:, 12] = old[:, 3], old[:, 5], old[:, 9]
        assert torch.equal(new, expect)


def test_forked_sample_decodes_from_copied_block(runner, tiny_llama_dir):
    """A fork shares full blocks and copies the partial last one: its greedy tokens match."""
    prompt = list(range(50, 61))  # 11 tokens: one full block and a partial one
    d = Driver(runner)
    d.add("p", prompt)
    first = d.step([d.chunk("p", 100)]).sampled_token_ids["p"][0]
    d.add("f", prompt, outputs=[first])
    d.done["f"] = len(prompt)
    d.tables["f"] = [d.tables["p"][0], d.free.pop()]
    for_copy = [(d.tables["p"][1], d.tables["f"][1])]
    out = d.step([d.chunk("p", 1), d.chunk("f", 1)], blocks_to_copy=for_copy)
    assert out.sampled_token_ids["p"] == out.sampled_token_ids["f"]
    assert [first, *out.sampled_token_ids["p"]] == _hf_greedy(tiny_llama_dir, prompt, 2)


def test_logprobs_and_drop(runner):
    d = Driver(runner)
    d.add("x", [1, 2, 3, 4], SamplingParams(temperature=1.0, seed=7, logprobs=2))
    out = d.step([d.chunk("x", 100)])
    (lp,) = out.logprobs["x"]
    assert lp.token_id == out.sampled_token_ids["x"][0] and len(lp.top) == 2
    assert runner.sampler.num_tracked_requests == 1
    runner.execute_model(
        SchedulerOutput(scheduled=[], num_batched_tokens=0, finished_request_ids=["x"])
    )
    assert runner.sampler.num_tracked_requests == 0 and "x" not in runner.input_batch


def test_kv_sizing_from_memory_and_log_line(tiny_llama_dir, caplog):
    cfg = make_config(tiny_llama_dir, num_blocks=None, kv_cache_memory=1 << 20)
    r = ModelRunner(cfg, model_dir=tiny_llama_dir)
    r.load_model()
    # 3 layers x K,V x 8 tokens x 2 KV heads x 16 dims x 4 bytes = 6144 bytes a block.
    assert r.kv_block_bytes() == 6144
    n = r.determine_num_blocks()
    assert n == (1 << 20) // 6144
    with caplog.at_level(logging.INFO, logger="tessera.engine"):
        r.init_kv_cache(n)
    tokens = (n - 1) * BLOCK
    assert (
        f"KV cache: {n} blocks ({tokens} tokens, float32); max concurrency at 128 tokens/request: "
        f"{tokens / 128:.2f}" in caplog.text
    )


def test_kv_sizing_from_the_variable_when_the_config_gives_none(tiny_llama_dir, monkeypatch):
    """TESSERA_KV_CACHE_MEMORY (the server's --kv-cache-memory variable) sizes an engine built
    without the option; the option wins over it; a bad value names the variable."""
    r = ModelRunner(make_config(tiny_llama_dir, num_blocks=None), model_dir=tiny_llama_dir)
    r.load_model()
    monkeypatch.setenv("TESSERA_KV_CACHE_MEMORY", "2MiB")
    assert r.determine_num_blocks() == (2 << 20) // 6144
    given = make_config(tiny_llama_dir, num_blocks=None, kv_cache_memory=1 << 20)
    r.config = given
    assert r.determine_num_blocks() == (1 << 20) // 6144
    r.config = make_config(tiny_llama_dir, num_blocks=None)
    for bad in ("lots", "0"):
        monkeypatch.setenv("TESSERA_KV_CACHE_MEMORY", bad)
        with pytest.raises(ValueError, match="TESSERA_KV_CACHE_MEMORY"):
            r.determine_num_blocks()


def test_kv_sizing_error_when_one_request_does_not_fit(tiny_llama_dir):
    cfg = make_config(tiny_llama_dir, num_blocks=None, kv_cache_memory=6144 * 10, max_model_len=256)
    r = ModelRunner(cfg, model_dir=tiny_llama_dir)
    r.load_model()
    with pytest.raises(ValueError, match=r"max_model_len 256.*--max-model-len.*--kv-cache-memory"):
        r.determine_num_blocks()
    with pytest.raises(ValueError, match="cannot hold one request"):
        r.init_kv_cache(16)
