"""Greedy output of the whole engine, token for token, against HF transformers (fp32).

Every scheduling path that changes how the KV cache is filled must leave the tokens unchanged:
prefix caching on and off, chunked prefill, recompute preemption, and n=2 forks; and
sliding-window models (Mistral, Qwen2 with use_sliding_window) with prompts and generations
well past their window.
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


def hf_greedy_gaps(model_dir, prompts, num_new: int) -> list[tuple[list[int], list[float]]]:
    """HF's greedy tokens of each prompt and, at each, its top-2 logit gap (eager, fp32; the
    whole context each step): the reference of a path whose numbers differ a little (int8
    activations), which may take the other side of a near tie."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids, tokens, gaps = list(prompt), [], []
            for _ in range(num_new):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                top = logits.topk(2).values
                tokens.append(int(logits.argmax()))
                gaps.append(float(top[0] - top[1]))
                ids.append(tokens[-1])
            out.append((tokens, gaps))
    return out


def assert_agrees_but_near_ties(got: list[list[int]], reference, tol: float) -> None:
    """Token for token with hf_greedy_gaps' reference, but where a token differs the
    reference's own choice was a near tie (top-2 gap under tol; the rest of that prompt then
    follows another path and is not compared)."""
    for ours, (theirs, gaps) in zip(got, reference, strict=True):
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a != b:
                assert gaps[i] < tol, f"token {i}: {a} != {b}, top-2 gap {gaps[i]:.4f}"
                break


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    lengths = [5, 17, 33, 48]  # under, over and across block boundaries
    shared = torch.randint(3, vocab_size, (20,), generator=g).tolist()
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
    # Two prompts sharing a 20-token prefix: exercise prefix-cache hits.
    prompts += [shared + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (7, 13)]
    return prompts


def engine_greedy(
    model_dir, prompts, *, n: int = 1, num_new: int = NUM_NEW, **llm_kwargs
) -> list[list[list[int]]]:
    llm = LLM(str(model_dir), dtype="float32", seed=0, **llm_kwargs)
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True, n=n)
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


# -- sliding-window models -----------------------------------------------------------------

SW_NUM_NEW = 40  # every prompt's generation runs past the window (16)
_SW_REFERENCES: dict = {}


def sliding_window_prompts(vocab_size: int) -> list[list[int]]:
    """Under, across and over the window; two sharing a 40-token prefix (2 full blocks: the
    second's hit starts behind its window) that run last, after the first's blocks were
    dropped behind the window and freed (still cached)."""
    g = torch.Generator().manual_seed(4321)
    shared = torch.randint(3, vocab_size, (40,), generator=g).tolist()
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40, 48)]
    prompts += [shared + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (7, 13)]
    return prompts


def _sw_reference(model_dir, prompts):
    key = str(model_dir)
    if key not in _SW_REFERENCES:  # eager attention: transformers' own sliding-window mask
        _SW_REFERENCES[key] = hf_greedy(model_dir, prompts, SW_NUM_NEW, attn_implementation="eager")
    return _SW_REFERENCES[key]


@pytest.mark.parametrize(
    "fixture, kv_window",
    [
        ("tiny_mistral_sw_dir", 16),  # every layer windowed: blocks behind it freed
        ("tiny_qwen2_all_sw_dir", 16),
        ("tiny_qwen2_sw_dir", None),  # layer 0 global: every block kept
    ],
)
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("prefix-caching", dict(enable_prefix_caching=True)),
        ("no-prefix-caching", dict(enable_prefix_caching=False)),
        ("chunked-prefill", dict(max_num_batched_tokens=16)),
        ("chunked-prefill-across-the-edge", dict(block_size=8, max_num_batched_tokens=11)),
        ("torch-backend", dict(attention_backend="torch", max_num_batched_tokens=32)),
        ("preemption", dict(num_kv_blocks=8, max_model_len=112, max_num_batched_tokens=64)),
    ],
)
def test_sliding_window_models_match_hf(request, fixture, kv_window, name, kwargs):
    """Mistral (sliding_window 16 on every layer) and Qwen2 with use_sliding_window (every
    layer, or layers >= max_window_layers = 1): HF's greedy tokens (eager attention, float32)
    past the window, however the cache is filled, and the context is not capped at it."""
    model_dir = request.getfixturevalue(fixture)
    from engine.models.loader import load_hf_config

    hf_config = load_hf_config(model_dir)
    assert hf_config.kv_sliding_window() == kv_window
    prompts = sliding_window_prompts(hf_config.vocab_size)
    expected = _sw_reference(model_dir, prompts)
    got, stats = engine_greedy(model_dir, prompts, num_new=SW_NUM_NEW, **kwargs)
    assert [g[0] for g in got] == expected
    if name == "prefix-caching":
        assert stats.prefix_cache_hits >= 32, "the shared prefix was not served from the cache"
    if name == "preemption":
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"


@pytest.mark.parametrize(
    "fixture, windows",
    [("tiny_mixtral_sw_dir", [16, 16, 16]), ("tiny_qwen2_moe_sw_dir", [16, None, 16])],
)
def test_sliding_window_mixtures_of_experts_match_hf(request, fixture, windows):
    """Mixtral (every layer) and Qwen2-MoE (its even layers below max_window_layers): the
    per-layer windows transformers gives them, its greedy tokens (chunked prefill, prefix
    caching)."""
    model_dir = request.getfixturevalue(fixture)
    from engine.models.loader import load_hf_config

    hf_config = load_hf_config(model_dir)
    assert hf_config.layer_sliding_windows == windows
    prompts = sliding_window_prompts(hf_config.vocab_size)
    expected = _sw_reference(model_dir, prompts)
    got, _ = engine_greedy(model_dir, prompts, num_new=SW_NUM_NEW, max_num_batched_tokens=16)
    assert [g[0] for g in got] == expected


def test_sliding_window_n2_forks_match_hf(tiny_mistral_sw_dir):
    """n = 2 forks of a request whose early blocks were dropped behind the window."""
    from engine.models.loader import load_hf_config

    prompts = sliding_window_prompts(load_hf_config(tiny_mistral_sw_dir).vocab_size)
    expected = _sw_reference(tiny_mistral_sw_dir, prompts)
    got, _ = engine_greedy(tiny_mistral_sw_dir, prompts, n=2, num_new=SW_NUM_NEW)
    for samples, want in zip(got, expected, strict=True):
        assert samples == [want, want]


def test_sliding_window_model_serves_its_whole_context(tiny_mistral_sw_dir):
    """No cap at the window: max_model_len is max_position_embeddings (512), served from a
    cache of 7 usable blocks (112 tokens: the window behind a 64-token chunk fits), and a
    long request holds its window's blocks only (ceil(16 / 16) + 1 after a decode step)."""
    llm = LLM(
        str(tiny_mistral_sw_dir),
        dtype="float32",
        seed=0,
        num_kv_blocks=8,
        max_num_batched_tokens=64,
    )
    assert llm.engine.max_model_len == 512
    manager = llm.engine.scheduler.kv_cache_manager
    assert manager.sliding_window == 16
    most = []
    real = manager.allocate_slots

    def spy(request, *args, **kwargs):
        out = real(request, *args, **kwargs)
        if out is not None and request.num_computed_tokens >= 100:
            most.append(manager.num_held_blocks(request.request_id))
        return out

    manager.allocate_slots = spy
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    out = llm.generate([list(range(3, 103))], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 300
    assert most and max(most) <= 2
    llm.shutdown()
