"""The int8 KV cache (engine.attention.kv_int8): the quantizer, the C writer against its torch
reference, the compiled kernel against the torch path on the same int8 cache, its accuracy
against float64 attention, and the engine end to end."""

from __future__ import annotations

import random

import pytest
import torch
from attention_testing import mixed_step

from engine.attention import cpu_kernel, kv_int8
from engine.attention.backends import cpu as cpu_backend
from engine.attention.backends.cpu import CpuAttentionBackend
from engine.attention.backends.torch import TorchAttentionBackend
from engine.attention.layer import PagedAttention
from engine.attention.metadata import common_metadata_from_seqs


def _kernel_or_skip(dtype=torch.bfloat16, kv_heads=3, head_dim=64):
    if not cpu_kernel.kernel_supports(dtype, torch.device("cpu"), kv_heads, head_dim):
        pytest.skip("no C compiler for the CPU kernel")


def test_quantize_round_trip():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-4, 3, 50)[:, None, None]
    x[7, 1] = 0  # an all-zero row: scale 0, values 0, no division by zero
    x[8, 2, 5] = -1e4  # an outlier sets its own row's scale only
    q, s = kv_int8.quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (50, 3)
    assert s[7, 1] == 0 and not q[7, 1].any()
    assert q[8, 2, 5] == -127 and s[8, 1] == x[8, 1].abs().max() / 127
    assert q.abs().max() == 127
    err = (q.float() * s[..., None] - x).abs()
    assert (err <= s[..., None] / 2 * (1 + 1e-6)).all()  # within half a step, row by row


@pytest.mark.parametrize("bs", [16, 8])
def test_cache_layout_keeps_every_value(bs):
    """The tiled block layout is a permutation: dequantizing gathered blocks gives back each
    token's quantized K and V in token order, and whole blocks can be gathered in any order."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, bs, 3, 64) * torch.logspace(-2, 1, bs)[None, None, :, None, None]
    cache, scales = kv_int8.quantize_cache(x)
    assert cache.shape == x.shape and cache.dtype == torch.int8 and scales.shape == (2, 5, 3, bs)
    assert not torch.equal(cache, kv_int8.quantize(x)[0])  # tiled, not token order
    q, s = kv_int8.quantize(x)
    order = torch.tensor([3, 0, 4])
    out = kv_int8.gather_dequantized(cache, scales, order, torch.empty(2, 3, bs, 3, 64))
    assert torch.equal(out, (q.float() * s[..., None])[:, order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_c_writer_stores_the_torch_bytes(dtype, head_dim):
    """Strided k/v views (as the QKV projection leaves them), scattered slots, rows at many
    scales: the C writer and the torch reference store identical int8 values and scales,
    including the round-half-to-even ties that bf16 inputs hit often."""
    _kernel_or_skip(dtype, 2, head_dim)
    torch.manual_seed(1)
    t, hkv, d, bs, nb = 300, 2, head_dim, 16, 40
    qkv = (torch.randn(t, 4 * hkv * d) * torch.logspace(-3, 2, t)[:, None]).to(dtype)
    k = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)  # row stride 4 * hkv * d
    v = qkv[:, 3 * hkv * d :].view(t, hkv, d)
    k[3] = 0
    slots = torch.tensor(random.Random(1).sample(range(bs, nb * bs), t))
    ref_cache = torch.zeros(2, nb, bs, hkv, d, dtype=torch.int8)
    ref_scales = kv_int8.allocate_scales(nb, bs, hkv, "cpu")
    cache, scales = ref_cache.clone(), ref_scales.clone()
    kv_int8.write(ref_cache, ref_scales, slots, k, v, use_kernel=False)
    kv_int8.write(cache, scales, slots, k, v)  # the C writer on this machine
    assert torch.equal(cache, ref_cache)
    assert torch.equal(scales, ref_scales)
    # and what was stored is k and v, quantized, at the right slots
    deq = kv_int8.gather_dequantized(
        cache, scales, torch.arange(nb), torch.empty(2, nb, bs, hkv, d)
    ).view(2, -1, hkv, d)
    assert torch.allclose(deq[0][slots], k.float(), atol=k.float().abs().max() / 254 * 1.01)
    assert torch.allclose(deq[1][slots], v.float(), atol=v.float().abs().max() / 254 * 1.01)


def _attend(cache, scales, q, k, v, seqs, heads, use_kernel):
    _, _, bs, kv_heads, d = cache.shape
    attn = PagedAttention(heads, kv_heads, d, d**-0.5)
    attn.kv_cache, attn.kv_scales = cache.clone(), None if scales is None else scales.clone()
    attn.kv_spec = None if scales is None else kv_int8.Int8KVCacheSpec(bs, kv_heads, d, q.dtype)
    attn.backend = (CpuAttentionBackend if use_kernel else TorchAttentionBackend)(
        bs, heads, kv_heads, d, q.dtype
    )
    meta = attn.backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    assert (getattr(meta, "kernel_decode", None) is not None) == use_kernel
    with torch.inference_mode():
        return attn(q, k, v, meta).double(), attn


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,bs,atol",
    [
        (torch.float32, 9, 3, 64, 16, 2e-3),  # AVX512-VNNI path where the CPU has it
        (torch.bfloat16, 9, 3, 64, 16, 1.6e-2),
        (torch.bfloat16, 8, 2, 128, 16, 1.6e-2),
        (torch.float32, 4, 4, 32, 16, 2e-3),
        (torch.bfloat16, 9, 3, 64, 32, 1.6e-2),  # two 16-token score tiles a block
        (torch.bfloat16, 12, 2, 64, 16, 1.6e-2),  # 6 query heads per KV head: 4 + 2
        (torch.bfloat16, 12, 2, 64, 8, 1.6e-2),  # blocks under 16 tokens: plain C loops
        (torch.float32, 4, 4, 48, 16, 1e-5),  # head_dim not a multiple of 32: plain C loops
    ],
)
@pytest.mark.parametrize("prefill_limit", [2048, 20])
def test_kernel_matches_torch_path_on_the_int8_cache(
    dtype, heads, kv_heads, head_dim, bs, atol, prefill_limit, monkeypatch
):
    """The same int8 cache through the torch path (dequantize, SDPA) and the kernel. The
    fresh prompt's own attention runs on the kernel from the cache it just wrote (limit
    2048) but on SDPA over its unquantized K/V on the torch path, so its rows are compared
    only when both run it on SDPA (limit 20)."""
    _kernel_or_skip(dtype, kv_heads, head_dim)
    monkeypatch.setattr(cpu_backend, "KERNEL_PREFILL_MAX_CONTEXT", prefill_limit)
    monkeypatch.setattr(cpu_backend, "AMX_KERNEL_PREFILL_MAX_CONTEXT", prefill_limit)
    torch.manual_seed(0)
    num_blocks = 200 * 16 // bs
    seqs, shared_rows = mixed_step(random.Random(0), bs, num_blocks)
    t = shared_rows + 23
    cache, scales = kv_int8.quantize_cache(torch.randn(2, num_blocks, bs, kv_heads, head_dim))
    q = torch.randn(t, heads, head_dim).to(dtype)
    k = torch.randn(t, kv_heads, head_dim).to(dtype)
    v = torch.randn(t, kv_heads, head_dim).to(dtype)
    ref, ref_attn = _attend(cache, scales, q, k, v, seqs, heads, use_kernel=False)
    out, attn = _attend(cache, scales, q, k, v, seqs, heads, use_kernel=True)
    rows = t if prefill_limit < 23 else shared_rows
    torch.testing.assert_close(out[:rows], ref[:rows], atol=atol, rtol=0)
    assert torch.equal(attn.kv_cache, ref_attn.kv_cache)  # the step's K/V, written alike
    assert torch.equal(attn.kv_scales, ref_attn.kv_scales)


def test_int8_cache_costs_little_accuracy_and_the_kernel_adds_none():
    """Against float64 attention over the unquantized K/V, on peaked scores like a trained
    model's: the int8 cache's error is a small fraction of the output's size, and the
    kernel (int16 queries, integer dot products) is as accurate as the torch path on the
    same int8 cache."""
    dtype, heads, kv_heads, d, bs = torch.bfloat16, 9, 3, 64, 16
    _kernel_or_skip(dtype, kv_heads, d)
    torch.manual_seed(0)
    num_blocks = 200
    seqs, rows = mixed_step(random.Random(0), bs, num_blocks)
    seqs = seqs[:-1]  # decodes and the cached-prefix chunk: every row reads the cache
    exact_cache = torch.randn(2, num_blocks, bs, kv_heads, d)
    exact_cache[0] *= 3
    q = (torch.randn(rows, heads, d) * 3).to(dtype)
    k = (torch.randn(rows, kv_heads, d) * 3).to(dtype)
    v = torch.randn(rows, kv_heads, d).to(dtype)
    flat = exact_cache.view(2, -1, kv_heads, d)
    slots = common_metadata_from_seqs(seqs, bs).slot_mapping
    flat[0][slots], flat[1][slots] = k.float(), v.float()  # the step's own K/V, unquantized
    exact = []
    for i, (start, n, blocks) in enumerate(seqs):
        keys = exact_cache[0][blocks].reshape(-1, kv_heads, d).double()
        values = exact_cache[1][blocks].reshape(-1, kv_heads, d).double()
        for j in range(n):
            length, row = start + j + 1, (i if n == 1 else rows - n + j)
            qg = q[row].double().view(kv_heads, heads // kv_heads, d)
            scores = torch.einsum("hgd,lhd->hgl", qg, keys[:length]) * d**-0.5
            exact.append(torch.einsum("hgl,lhd->hgd", scores.softmax(-1), values[:length]))
    exact = torch.stack(exact).reshape(rows, -1)
    cache, scales = kv_int8.quantize_cache(exact_cache)
    torch_err = (_attend(cache, scales, q, k, v, seqs, heads, False)[0] - exact).abs().mean()
    kernel_err = (_attend(cache, scales, q, k, v, seqs, heads, True)[0] - exact).abs().mean()
    assert kernel_err <= 1.05 * torch_err, (kernel_err, torch_err)
    assert torch_err < 0.02 * exact.abs().mean(), (torch_err, exact.abs().mean())


def test_engine_with_an_int8_cache(tiny_llama_dir):
    """LLM(kv_cache_dtype="int8"): the cache is int8 with scales, a block costs a fraction of
    a float32 one (more blocks for the same budget), prefix-cache hits and n=2 forks
    (copied blocks carry their scales) give the cold run's greedy tokens, and the greedy
    output stays close to the float cache's."""
    from engine import LLM, SamplingParams
    from engine.args import EngineArgs

    budget = 4 * 2**20
    base = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=budget)
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=budget, kv_cache_dtype="int8")
    runner = llm.engine.executor.runner
    assert all(c.dtype == torch.int8 for c in runner.kv_caches)
    assert len(runner.kv_scales) == len(runner.kv_caches)
    attn = next(iter(runner.model.attention_layers()))
    assert attn.kv_scales is runner.kv_scales[0]
    base_runner = base.engine.executor.runner
    # per layer, K and V of 16 tokens x 2 KV heads x head_dim 16: float32 values (4 bytes),
    # or int8 values plus one float32 scale per token and head
    layers = len(runner.kv_caches)
    assert base_runner.kv_block_bytes() == layers * 2 * 16 * 2 * 16 * 4
    assert runner.kv_block_bytes() == layers * 2 * 16 * 2 * (16 + 4)
    assert runner.num_blocks == budget // runner.kv_block_bytes() > 3 * base_runner.num_blocks

    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 40)]
    cold = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    warm = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert warm == cold  # prompts served from cached int8 blocks
    assert llm.engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
    fork = SamplingParams(n=2, max_tokens=12, ignore_eos=True, temperature=0)
    two = llm.generate(prompts[2:], fork, use_tqdm=False)
    assert [c.token_ids for c in two[0].outputs] == [cold[2], cold[2]]
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]
    same = sum(a == b for r, c in zip(ref, cold, strict=True) for a, b in zip(r, c, strict=True))
    assert same >= 0.75 * sum(map(len, ref)), (ref, cold)
    base.shutdown()
    llm.shutdown()
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, int8 or fp8"):
        EngineArgs(kv_cache_dtype="fp4").create_engine_config()
