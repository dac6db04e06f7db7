"""Greedy output of the whole engine, token for token, against HF transformers (fp32).

Every scheduling path that changes how the KV cache is filled must leave the tokens unchanged:
prefix caching on and off, chunked prefill, recompute preemption, and n=2 forks.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

NUM_NEW = 12


def hf_greedy(model_dir, prompts: list[list[int]], num_new: int, **load) -> list[list[int]]:
    """Reference: HF forward with its own KV cache, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **load)
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model(input_ids=ids, use_cache=True)
            tokens = []
            for _ in range(num_new):
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                out = model(
                    input_ids=torch.tensor([[nxt]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            results.append(tokens)
    return results


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths = [5, 17, 33, 48]  # under, over and across block boundaries
    shared = torch.randint(3, vocab_size, (20,), generator=g).tolist()
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
    # Two prompts sharing a 20-token prefix: exercise prefix-cache hits.
    prompts += [shared + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (7, 13)]
    return prompts


def engine_greedy(model_dir, prompts, *, n: int = 1, **llm_kwargs) -> list[list[list[int]]]:
    llm = LLM(str(model_dir), dtype="float32", seed=0, **llm_kwargs)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, n=n)
    # The shared-prefix prompts run after the others finish, so their prefix is cached.
    first = llm.generate(prompts[:-1], params, use_tqdm=False)
    last = llm.generate(prompts[-1:], params, use_tqdm=False)
    outs = first + last
    stats = llm.engine.scheduler.stats()
    assert stats.kv_usage == 0.0, "blocks leaked after every request finished"
    llm.shutdown()
    return [[list(c.token_ids) for c in o.outputs] for o in outs], stats


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    from engine.models.loader import load_hf_config

    prompts = make_prompts(load_hf_config(tiny_llama_dir).vocab_size)
    return prompts, hf_greedy(tiny_llama_dir, prompts, NUM_NEW)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("prefix-caching", dict(enable_prefix_caching=True)),
        ("no-prefix-caching", dict(enable_prefix_caching=False)),
        ("chunked-prefill", dict(max_num_batched_tokens=16)),
        ("preemption", dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64)),
        ("one-seq-at-a-time", dict(max_num_seqs=1)),
    ],
)
def test_greedy_matches_hf(tiny_llama_dir, reference, name, kwargs):
    prompts, expected = reference
    got, stats = engine_greedy(tiny_llama_dir, prompts, **kwargs)
    assert [g[0] for g in got] == expected
    if name == "prefix-caching":
        assert stats.prefix_cache_hits >= 16, "the shared prefix was not served from the cache"
    if name == "preemption":
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"


def test_n2_forks_match_hf(tiny_llama_dir, reference):
    prompts, expected = reference
    got, _ = engine_greedy(tiny_llama_dir, prompts, n=2)
    for samples, want in zip(got, expected, strict=True):
        assert samples == [want, want]


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_llama3_dir"])
def test_other_architectures_match_hf(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    from engine.models.loader import load_hf_config

    prompts = make_prompts(load_hf_config(model_dir).vocab_size)
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    got, _ = engine_greedy(model_dir, prompts, max_num_batched_tokens=32)
    assert [g[0] for g in got] == expected


@pytest.mark.parametrize(
    "fixture", ["tiny_mixtral_dir", "tiny_qwen2_moe_dir", "tiny_qwen3_moe_dir"]
)
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("prefix-caching", dict(enable_prefix_caching=True)),
        ("no-prefix-caching", dict(enable_prefix_caching=False)),
        ("chunked-prefill", dict(max_num_batched_tokens=16)),
    ],
)
def test_mixture_of_experts_match_hf(request, fixture, name, kwargs):
    """Mixtral, Qwen2-MoE (shared expert) and Qwen3-MoE (a dense layer among the MoE ones):
    HF's greedy tokens, whichever way the cache is filled."""
    model_dir = request.getfixturevalue(fixture)
    from engine.models.loader import load_hf_config

    prompts = make_prompts(load_hf_config(model_dir).vocab_size)
    expected = _eager_reference(model_dir, prompts)
    got, stats = engine_greedy(model_dir, prompts, **kwargs)
    assert [g[0] for g in got] == expected
    if name == "prefix-caching":
        assert stats.prefix_cache_hits >= 16, "the shared prefix was not served from the cache"


@pytest.mark.parametrize(
    "fixture", ["tiny_phi3_dir", "tiny_phi3_longrope_dir", "tiny_phi4_mini_dir", "tiny_gemma3_dir"]
)
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("prefix-caching", dict(enable_prefix_caching=True)),
        ("no-prefix-caching", dict(enable_prefix_caching=False)),
        ("chunked-prefill", dict(max_num_batched_tokens=16)),
    ],
)
def test_phi3_and_gemma3_match_hf(request, fixture, name, kwargs):
    """Phi-3 (fused qkv_proj / gate_up_proj split at load), Phi-3 with LongRoPE (original
    context 56: the 48-token prompts decode past it, onto the long factors) and Phi-4-mini's
    partial rotary with LongRoPE, and Gemma 3 (its norms, GeGLU, scaled embeddings, local and
    global rope): HF's greedy tokens, whichever way the cache is filled."""
    model_dir = request.getfixturevalue(fixture)
    from engine.models.loader import load_hf_config

    prompts = make_prompts(load_hf_config(model_dir).vocab_size)
    expected = _eager_reference(model_dir, prompts)
    got, stats = engine_greedy(model_dir, prompts, **kwargs)
    assert [g[0] for g in got] == expected
    if name == "prefix-caching":
        assert stats.prefix_cache_hits >= 16, "the shared prefix was not served from the cache"


_REFERENCES: dict = {}


def _eager_reference(model_dir, prompts):
    """HF's greedy tokens with eager attention, once per model folder."""
    key = str(model_dir)
    if key not in _REFERENCES:
        _REFERENCES[key] = hf_greedy(model_dir, prompts, NUM_NEW, attn_implementation="eager")
    return _REFERENCES[key]
