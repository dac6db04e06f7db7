"""Attention backends (engine.attention.backends) on the same common metadata: the torch
reference against float64 attention, the cpu backend against the torch reference (bf16,
float32 and the int8 cache), the static-buffer hooks of a graph runner, select_backend's
choices and errors, and the --attention-backend flag end to end."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from attention_testing import drop_blocks_before_window, mixed_step

from engine.attention import kv_int8
from engine.attention.backends import (
    ATTENTION_BACKEND_CHOICES,
    BACKENDS,
    backend_class,
    select_backend,
)
from engine.attention.backends import cpu as cpu_backend
from engine.attention.backends.cpu import CpuAttentionBackend, CpuAttentionMetadata
from engine.attention.backends.torch import TorchAttentionBackend, TorchAttentionMetadata
from engine.attention.backends.triton import triton_import_error
from engine.attention.layer import PagedAttention
from engine.attention.metadata import common_metadata_from_seqs
from engine.config import ModelConfig

CPU = torch.device("cpu")
# Kernel against the torch path: as tests/engine/models/test_attention_kernel.py and
# test_kv_int8.py state them (float sums in another order; bf16 outputs rounded once).
ATOL = {(torch.float32, False): 1e-5, (torch.bfloat16, False): 1.6e-2}
ATOL |= {(torch.float32, True): 2e-3, (torch.bfloat16, True): 1.6e-2}


def _cpu_or_skip(dtype, kv_heads, head_dim):
    why = CpuAttentionBackend.unsupported_reason(CPU, dtype, "auto", kv_heads, head_dim)
    if why is not None:
        pytest.skip(f"cpu backend unavailable: {why}")


def _step(scenario: str, bs: int, num_blocks: int, seed: int = 0):
    """(start_pos, num_tokens, block_ids) per request, decodes first by context; every
    request's blocks drawn from a shuffled pool: non-contiguous and out of order."""
    rng = random.Random(seed)
    if scenario == "mixed":  # the kernel tests' step: decodes, a prefix hit, a fresh prompt
        return mixed_step(rng, bs, num_blocks)[0]
    free = list(range(1, num_blocks))
    rng.shuffle(free)

    def blocks(ctx: int, spare: int = 0) -> list[int]:
        return [free.pop() for _ in range(-(-ctx // bs) + spare)]

    num_decodes = {"decodes": 9, "many-decodes": 140}.get(scenario, 5)
    ctx = sorted(rng.randint(1, 5 * bs + 3) for _ in range(num_decodes))
    # one spare block on some: the scheduler may hold more blocks than the context needs
    seqs = [(c - 1, 1, blocks(c, spare=i % 2)) for i, c in enumerate(ctx)]
    if scenario == "prefix-hit":  # chunks on top of cached blocks: block-aligned and not
        seqs += [(2 * bs, 9, blocks(2 * bs + 9)), (bs + 5, 2 * bs - 1, blocks(3 * bs + 4))]
    elif scenario == "chunked-prefill":  # a prompt's second chunk, another prompt's first
        seqs += [(bs, bs, blocks(2 * bs)), (0, bs + 3, blocks(bs + 3))]
    elif scenario == "long-prefill":  # a chunk past KERNEL_PREFILL_MAX_CONTEXT (patched)
        seqs += [(7, 13, blocks(20)), (3 * bs + 1, 2 * bs, blocks(5 * bs + 1)), (0, 6, blocks(6))]
    return seqs


def _attend(backend, cache, scales, q, k, v, meta):
    _, _, _, kv_heads, d = cache.shape
    attn = PagedAttention(q.shape[1], kv_heads, d, d**-0.5)
    attn.kv_cache, attn.kv_scales = cache.clone(), None if scales is None else scales.clone()
    bs = cache.shape[2]
    attn.kv_spec = None if scales is None else kv_int8.Int8KVCacheSpec(bs, kv_heads, d, q.dtype)
    attn.backend = backend
    with torch.inference_mode():
        return attn(q, k, v, meta), attn


def _inputs(seqs, heads, kv_heads, d, bs, num_blocks, dtype, int8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(n for _, n, _ in seqs)
    full = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g)
    cache, scales = kv_int8.quantize_cache(full) if int8 else (full.to(dtype), None)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    return cache, scales, q, k, v


def _exact(cache, q, seqs, window: int | None = None, sinks=None) -> torch.Tensor:
    """float64 attention of every query row over the written (float) cache, token by token;
    with a window, over keys i - window < j <= i only (transformers' sliding-window mask);
    with sinks [H], each head's sink a softmax column with no value (transformers' gpt-oss)."""
    kv_heads, d = cache.shape[-2:]
    heads, rows, row = q.shape[1], [], 0
    for start, n, ids in seqs:
        keys = cache[0][list(ids)].reshape(-1, kv_heads, d).double()
        values = cache[1][list(ids)].reshape(-1, kv_heads, d).double()
        for j in range(n):
            length = start + j + 1
            first = 0 if window is None else max(0, length - window)
            qg = q[row].double().view(kv_heads, heads // kv_heads, d)
            scores = torch.einsum("hgd,lhd->hgl", qg, keys[first:length]) * d**-0.5
            if sinks is not None:
                sink = sinks.double().view(kv_heads, -1, 1)
                probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            rows.append(torch.einsum("hgl,lhd->hgd", probs, values[first:length]))
            row += 1
    return torch.stack(rows).reshape(row, -1)


NUM_BLOCKS = 1200  # 140 decodes of up to 6 blocks each fit
SCENARIOS = ["decodes", "many-decodes", "prefix-hit", "chunked-prefill", "long-prefill", "mixed"]
SHAPES = [(4, 4, 32), (8, 2, 64), (16, 2, 64)]  # GQA ratios 1, 4, 8


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("bs", [16, 8])
def test_torch_reference_matches_float64_attention(scenario, heads, kv_heads, head_dim, bs):
    """The reference itself, on float32: ragged lengths, holes in block tables, GQA."""
    num_blocks = NUM_BLOCKS * 16 // bs
    seqs = _step(scenario, bs, num_blocks)
    cache, _, q, k, v = _inputs(seqs, heads, kv_heads, head_dim, bs, num_blocks, torch.float32, 0)
    backend = TorchAttentionBackend(bs, heads, kv_heads, head_dim, torch.float32)
    meta = backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    if scenario == "many-decodes":
        assert len(meta.decode_groups) == 2  # 140 decodes: groups of 64 or more
    out, attn = _attend(backend, cache, None, q, k, v, meta)
    exact = _exact(attn.kv_cache, q, seqs)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["kv-model-dtype", "kv-int8"])
def test_cpu_backend_matches_torch_reference(
    scenario, heads, kv_heads, head_dim, dtype, int8, monkeypatch
):
    _cpu_or_skip(dtype, kv_heads, head_dim)
    bs, num_blocks = 16, NUM_BLOCKS
    limit = 40 if scenario == "long-prefill" else cpu_backend.KERNEL_PREFILL_MAX_CONTEXT
    monkeypatch.setattr(cpu_backend, "KERNEL_PREFILL_MAX_CONTEXT", limit)
    monkeypatch.setattr(cpu_backend, "AMX_KERNEL_PREFILL_MAX_CONTEXT", limit)
    seqs = _step(scenario, bs, num_blocks)
    cache, scales, q, k, v = _inputs(seqs, heads, kv_heads, head_dim, bs, num_blocks, dtype, int8)
    common = common_metadata_from_seqs(seqs, bs)
    torch_backend = TorchAttentionBackend(bs, heads, kv_heads, head_dim, dtype)
    cpu = CpuAttentionBackend(bs, heads, kv_heads, head_dim, dtype)
    ref_meta, meta = torch_backend.build_metadata(common), cpu.build_metadata(common)
    assert type(ref_meta) is TorchAttentionMetadata and isinstance(meta, CpuAttentionMetadata)
    # the kernel takes every decode and the leading chunks within the limit; SDPA the rest
    kernel_reqs = common.num_decodes
    while kernel_reqs < len(seqs) and seqs[kernel_reqs][0] + seqs[kernel_reqs][1] <= limit:
        kernel_reqs += 1
    kernel_rows = sum(n for _, n, _ in seqs[:kernel_reqs])
    assert meta.kernel_decode.num_rows == kernel_rows and not meta.decode_groups
    assert len(meta.prefills) == len(seqs) - kernel_reqs
    ref, ref_attn = _attend(torch_backend, cache, scales, q, k, v, ref_meta)
    out, attn = _attend(cpu, cache, scales, q, k, v, meta)
    assert torch.equal(attn.kv_cache, ref_attn.kv_cache)  # the step's K/V, written alike
    if int8:
        assert torch.equal(attn.kv_scales, ref_attn.kv_scales)
    # With an int8 cache a fresh prompt's rows on the kernel read its quantized K/V, while
    # SDPA (torch) attends to them unquantized: compare the rows that read the cache alike.
    same_inputs = torch.ones(q.shape[0], dtype=torch.bool)
    row = 0
    for r, (start, n, _) in enumerate(seqs):
        if int8 and start == 0 and n > 1 and r < kernel_reqs:
            same_inputs[row : row + n] = False
        row += n
    torch.testing.assert_close(
        out[same_inputs].float(), ref[same_inputs].float(), atol=ATOL[dtype, int8], rtol=0
    )


def _assert_rows_read_alike(out, ref, seqs, int8: bool, limit: int, dtype) -> None:
    """out against ref on the rows both read alike: with an int8 cache a fresh prompt's rows on
    the kernel (contexts up to limit) read its quantized K/V, SDPA its unquantized ones."""
    same_inputs = torch.ones(out.shape[0], dtype=torch.bool)
    row = 0
    for start, n, _ in seqs:
        if int8 and start == 0 and n > 1 and start + n <= limit:
            same_inputs[row : row + n] = False
        row += n
    torch.testing.assert_close(
        out[same_inputs].float(), ref[same_inputs].float(), atol=ATOL[dtype, int8], rtol=0
    )


WINDOWS = [1, 7, 16, 33]  # one key; under a block; a block exactly; over two blocks


def _windowed(seqs, window, bs, cache, scales):
    """The step as the manager leaves it under the window (engine.core.kv_cache_manager), the
    dropped blocks poisoned with NaN (an int8 cache: their scales)."""
    seqs, dropped = drop_blocks_before_window(seqs, window, bs)
    if dropped:
        (scales if scales is not None else cache)[:, dropped] = float("nan")
    return seqs


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("bs", [16, 8])
def test_torch_reference_with_a_sliding_window_matches_float64(scenario, window, bs):
    """A layer with a sliding window attends keys i - W < j <= i only: ragged decodes past
    the window, prefix hits and chunks across its edge, fresh prompts longer than it; the
    blocks wholly before a request's window freed (the null block in its table) or poisoned,
    never read. A layer without a window in the same step still attends everything."""
    heads, kv_heads, head_dim = 8, 2, 32
    num_blocks = NUM_BLOCKS * 16 // bs
    seqs = _step(scenario, bs, num_blocks)
    cache, _, q, k, v = _inputs(seqs, heads, kv_heads, head_dim, bs, num_blocks, torch.float32, 0)
    full_cache = cache.clone()
    seqs_w = _windowed(seqs, window, bs, cache, None)
    backend = TorchAttentionBackend(bs, heads, kv_heads, head_dim, torch.float32)
    meta = backend.build_metadata(common_metadata_from_seqs(seqs_w, bs))
    attn = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
    attn.kv_cache, attn.backend = cache.clone(), backend
    with torch.inference_mode():
        out = attn(q, k, v, meta)
    assert not out.isnan().any()
    exact = _exact(attn.kv_cache, q, seqs_w, window)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=0)
    # the same step's metadata serves a layer without a window (on an unpoisoned cache)
    full_meta = backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    out_full, full_attn = _attend(backend, full_cache, None, q, k, v, full_meta)
    with torch.inference_mode():
        attn.kv_cache = full_cache.clone()
        out_w = attn(q, k, v, full_meta)  # windowed layer first, then a full one: both right
        out_full2 = full_attn(q, k, v, full_meta)
    torch.testing.assert_close(
        out_full.double(), _exact(full_attn.kv_cache, q, seqs), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(out_full2, out_full, atol=0, rtol=0)
    torch.testing.assert_close(
        out_w.double(), _exact(attn.kv_cache, q, seqs, window), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["kv-model-dtype", "kv-int8"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_cpu_backend_with_a_sliding_window_matches_torch(
    scenario, window, dtype, int8, head_dim, monkeypatch
):
    """The C kernels take the window (each row from the block of its first key, the keys
    before it in that block masked): every kernel variant against the torch reference (head
    dim 48: the plain loops where 64 takes AVX-512's), the freed blocks never read; the long
    prefill chunks on the torch path masked too."""
    heads, kv_heads = 8, 2
    _cpu_or_skip(dtype, kv_heads, head_dim)
    bs, num_blocks = 16, NUM_BLOCKS
    limit = 40 if scenario == "long-prefill" else cpu_backend.KERNEL_PREFILL_MAX_CONTEXT
    monkeypatch.setattr(cpu_backend, "KERNEL_PREFILL_MAX_CONTEXT", limit)
    monkeypatch.setattr(cpu_backend, "AMX_KERNEL_PREFILL_MAX_CONTEXT", limit)
    seqs = _step(scenario, bs, num_blocks)
    cache, scales, q, k, v = _inputs(seqs, heads, kv_heads, head_dim, bs, num_blocks, dtype, int8)
    seqs = _windowed(seqs, window, bs, cache, scales)
    common = common_metadata_from_seqs(seqs, bs)
    torch_backend = TorchAttentionBackend(bs, heads, kv_heads, head_dim, dtype)
    cpu = CpuAttentionBackend(bs, heads, kv_heads, head_dim, dtype)
    outs = []
    for backend in (torch_backend, cpu):
        attn = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window)
        attn.kv_cache, attn.kv_scales = cache.clone(), None if scales is None else scales.clone()
        attn.kv_spec = kv_int8.Int8KVCacheSpec(bs, kv_heads, head_dim, dtype) if int8 else None
        attn.backend = backend
        with torch.inference_mode():
            outs.append(attn(q, k, v, backend.build_metadata(common)))
    ref, out = outs
    assert not ref.isnan().any() and not out.isnan().any()
    _assert_rows_read_alike(out, ref, seqs, int8, limit, dtype)


def _sinks(heads: int) -> torch.Tensor:
    """gpt-oss-like sinks: some heads' sink far above their scores (most weight on nothing),
    some far below (no effect), the rest comparable."""
    g = torch.Generator().manual_seed(7)
    sinks = torch.randn(heads, generator=g) * 2
    sinks[0], sinks[-1] = 6.0, -30.0
    return sinks


@pytest.mark.parametrize("scenario", ["mixed", "many-decodes", "prefix-hit", "long-prefill"])
@pytest.mark.parametrize("window", [None, 7])
def test_torch_reference_with_sinks_matches_float64(scenario, window):
    """Attention sinks (gpt-oss): each head's sink joins its softmax with no value; decodes
    (grouped-query heads as rows), prefix hits, fresh prompts, under a window too."""
    heads, kv_heads, head_dim, bs = 8, 2, 32, 16
    seqs = _step(scenario, bs, NUM_BLOCKS)
    cache, _, q, k, v = _inputs(seqs, heads, kv_heads, head_dim, bs, NUM_BLOCKS, torch.float32, 0)
    if window is not None:
        seqs = _windowed(seqs, window, bs, cache, None)
    backend = TorchAttentionBackend(bs, heads, kv_heads, head_dim, torch.float32)
    meta = backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    attn = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, window, sinks=True)
    attn.sinks.data.copy_(_sinks(heads))
    attn.kv_cache, attn.backend = cache.clone(), backend
    with torch.inference_mode():
        out = attn(q, k, v, meta)
    exact = _exact(attn.kv_cache, q, seqs, window, attn.sinks)
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=0)
    # the sinks matter: the same step without them differs
    assert (exact - _exact(attn.kv_cache, q, seqs, window)).abs().max() > 0.1


@pytest.mark.parametrize("scenario", ["mixed", "decodes", "long-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True], ids=["kv-model-dtype", "kv-int8"])
@pytest.mark.parametrize("head_dim,window", [(64, None), (48, None), (64, 7)])
def test_cpu_backend_with_sinks_matches_torch(scenario, dtype, int8, head_dim, window, monkeypatch):
    """The C kernels' sinks (every variant: plain loops at head dim 48, AVX-512 bf16 and
    VNNI int8 at 64) against the torch reference, which also runs the long prefill chunks."""
    heads, kv_heads = 8, 2
    _cpu_or_skip(dtype, kv_heads, head_dim)
    bs = 16
    limit = 40 if scenario == "long-prefill" else cpu_backend.KERNEL_PREFILL_MAX_CONTEXT
    monkeypatch.setattr(cpu_backend, "KERNEL_PREFILL_MAX_CONTEXT", limit)
    monkeypatch.setattr(cpu_backend, "AMX_KERNEL_PREFILL_MAX_CONTEXT", limit)
    seqs = _step(scenario, bs, NUM_BLOCKS)
    cache, scales, q, k, v = _inputs(seqs, heads, kv_heads, head_dim, bs, NUM_BLOCKS, dtype, int8)
    if window is not None:
        seqs = _windowed(seqs, window, bs, cache, scales)
    common = common_metadata_from_seqs(seqs, bs)
    outs = []
    for backend in (
        TorchAttentionBackend(bs, heads, kv_heads, head_dim, dtype),
        CpuAttentionBackend(bs, heads, kv_heads, head_dim, dtype),
    ):
        attn = PagedAttention(heads, kv_heads, head_dim, head_dim**-0.5, window, sinks=True)
        attn.sinks.data.copy_(_sinks(heads))
        attn.kv_cache, attn.kv_scales = cache.clone(), None if scales is None else scales.clone()
        attn.kv_spec = kv_int8.Int8KVCacheSpec(bs, kv_heads, head_dim, dtype) if int8 else None
        attn.backend = backend
        with torch.inference_mode():
            outs.append(attn(q, k, v, backend.build_metadata(common)))
    ref, out = outs
    _assert_rows_read_alike(out, ref, seqs, int8, limit, dtype)


@pytest.mark.parametrize("name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype,int8", [(torch.float32, False), (torch.bfloat16, True)])
def test_static_buffers_give_what_fresh_metadata_gives(name, dtype, int8, monkeypatch):
    """A graph runner's hooks: buffers for a maximum batch, filled in place step after step
    (different sizes, kinds and lengths), give bit for bit the output of fresh metadata, and
    the tensors the step reads live in those buffers."""
    if name == "cpu":
        _cpu_or_skip(dtype, 2, 64)
    monkeypatch.setattr(cpu_backend, "KERNEL_PREFILL_MAX_CONTEXT", 40)  # some SDPA chunks too
    monkeypatch.setattr(cpu_backend, "AMX_KERNEL_PREFILL_MAX_CONTEXT", 40)
    bs = 16
    backend = backend_class(name)(bs, 8, 2, 64, dtype)
    static = backend.allocate_static_metadata(max_rows=256, max_blocks_per_req=12)
    first_slots = None
    for seed, scenario in enumerate(["many-decodes", "mixed", "long-prefill", "decodes"]):
        seqs = _step(scenario, bs, NUM_BLOCKS, seed)
        cache, scales, q, k, v = _inputs(seqs, 8, 2, 64, bs, NUM_BLOCKS, dtype, int8, seed)
        common = common_metadata_from_seqs(seqs, bs)
        fresh_out, fresh_attn = _attend(
            backend, cache, scales, q, k, v, backend.build_metadata(common)
        )
        meta = backend.fill_static_metadata(static, common)
        out, attn = _attend(backend, cache, scales, q, k, v, meta)
        assert torch.equal(out, fresh_out)
        assert torch.equal(attn.kv_cache, fresh_attn.kv_cache)
        # in place: the slot mapping (and the kernel's tables) start where they always do
        first_slots = first_slots or meta.slot_mapping.data_ptr()
        assert meta.slot_mapping.data_ptr() == first_slots
        if name == "cpu":
            kd = meta.kernel_decode
            assert kd.block_tables.data_ptr() == static.block_tables.data_ptr()
            assert kd.context_lens.data_ptr() == static.context_lens.data_ptr()
            assert kd.block_tables.shape[1] == 12  # the static width, whatever the step's
        storage = static.torch_part.storage if name == "cpu" else static.storage
        for g in meta.decode_groups:
            base = storage[torch.int64]
            offset = g.block_table.data_ptr() - base.data_ptr()
            assert 0 <= offset < base.numel() * base.element_size()
    too_long = [(12 * bs, 1, list(range(1, 14)))]  # 13 blocks: one more than the buffers hold
    with pytest.raises(ValueError, match="does not fit static buffers"):
        backend.fill_static_metadata(static, common_metadata_from_seqs(too_long, bs))


def test_common_metadata_is_flat_and_exact():
    """Query offsets, lengths, the int32 block table (padded with block 0, spare blocks
    dropped) and the slot of every token; block ids as a list or an int32 numpy array."""
    import numpy as np

    bs = 4
    seqs = [(2, 1, [9, 3]), (5, 1, np.array([7, 2, 11], dtype=np.int32)), (3, 6, [4, 8, 1])]
    c = common_metadata_from_seqs(seqs, bs)
    assert c.query_start_loc.tolist() == [0, 1, 2, 8] and c.query_start_loc.dtype == torch.int32
    assert c.seq_lens.tolist() == [3, 6, 9]
    assert c.block_table.dtype == torch.int32
    assert c.block_table.tolist() == [[9, 0, 0], [7, 2, 0], [4, 8, 1]]
    assert c.slot_mapping.dtype == torch.int64
    assert c.slot_mapping.tolist() == [9 * 4 + 2, 2 * 4 + 1, 4 * 4 + 3, 32, 33, 34, 35, 4]
    assert (c.num_reqs, c.num_actual_tokens, c.num_decodes, c.num_decode_tokens) == (3, 8, 2, 2)
    assert (c.max_query_len, c.max_seq_len) == (6, 9)
    as_arrays = [(a, n, np.asarray(ids, dtype=np.int32)) for a, n, ids in seqs]
    for other in (
        common_metadata_from_seqs(as_arrays, bs),
        common_metadata_from_seqs(seqs[2:], bs),
    ):
        rows = slice(0, 3) if other.num_reqs == 3 else slice(2, 3)
        assert torch.equal(other.block_table, c.block_table[rows, : other.block_table.shape[1]])
    assert torch.equal(common_metadata_from_seqs(as_arrays, bs).slot_mapping, c.slot_mapping)
    with pytest.raises(ValueError, match="has only 1 blocks"):
        common_metadata_from_seqs([(4, 1, [5])], bs)


def test_select_backend_choices_and_errors():
    assert set(BACKENDS) == {"torch", "cpu", "triton"} and ATTENTION_BACKEND_CHOICES[0] == "auto"
    cpu_ok = CpuAttentionBackend.unsupported_reason(CPU, torch.bfloat16, "auto", 3, 64) is None
    auto = select_backend("auto", "cpu", torch.bfloat16, "auto", 3, 64)
    assert auto.backend is (CpuAttentionBackend if cpu_ok else TorchAttentionBackend)
    assert auto.reason.startswith("auto: ")
    # float16: no C kernel; auto falls back to torch and says why
    half = select_backend("auto", "cpu", torch.float16, "int8", 3, 64)
    assert half.backend is TorchAttentionBackend and "float32 or bfloat16" in half.reason
    gpu = select_backend("auto", torch.device("cuda"), torch.bfloat16, "auto", 8, 128)
    if triton_import_error() is None:  # CUDA: triton where it imports, else torch
        assert gpu.backend.name == "triton"
    else:
        assert gpu.backend is TorchAttentionBackend and "CPU" in gpu.reason
    for device in ("cpu", "cuda"):  # torch runs anywhere
        chosen = select_backend("torch", device, torch.float16, "int8", 8, 128)
        assert chosen.backend is TorchAttentionBackend
    with pytest.raises(ValueError, match="'cpu' cannot run this model: .*float32 or bfloat16"):
        select_backend("cpu", "cpu", torch.float16, "auto", 3, 64)
    with pytest.raises(ValueError, match="'cpu' cannot run this model: .*CPU.*cuda"):
        select_backend("cpu", "cuda", torch.bfloat16, "auto", 3, 64)
    if CpuAttentionBackend.unsupported_reason(CPU, torch.float32, "auto", 2, 16) is None:
        with pytest.raises(ValueError, match="row buffer"):
            select_backend("cpu", "cpu", torch.float32, "auto", 16, 128)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*auto, torch, cpu"):
        select_backend("flash", "cpu", torch.float32, "auto", 2, 16)
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu"):
        ModelConfig(attention_backend="flash")


def test_layer_without_a_backend_says_so():
    attn = PagedAttention(4, 2, 16, 0.25)
    meta = TorchAttentionBackend(16, 4, 2, 16, torch.float32).build_metadata(
        common_metadata_from_seqs([(0, 3, [1])], 16)
    )
    with pytest.raises(RuntimeError, match="no attention backend is bound"):
        attn(torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), meta)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_flag_end_to_end_same_greedy_tokens(tiny_llama_dir, kv_cache_dtype, caplog):
    """LLM(..., attention_backend=...): the runner binds the chosen backend to every layer,
    logs it once, and torch and cpu give the same greedy tokens (float32; prefix hits and
    chunked prefill included)."""
    from engine import LLM, SamplingParams

    _cpu_or_skip(torch.float32, 2, 16)
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 200, (20,), generator=g).tolist()
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 40)]
    prompts += [shared + [5, 6, 7], shared + [9] * 11]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for name in ("torch", "cpu"):
        with caplog.at_level(logging.INFO, logger="tessera.engine"):
            llm = LLM(
                str(tiny_llama_dir), dtype="float32", attention_backend=name,
                kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32, num_kv_blocks=64,
            )  # fmt: skip
        runner = llm.engine.executor.runner
        assert runner.attn_backend.name == name
        assert all(a.backend is runner.attn_backend for a in runner.model.attention_layers())
        assert f"attention backend: {name} (chosen explicitly)" in caplog.text
        first = llm.generate(prompts[:-1], params, use_tqdm=False)
        last = llm.generate(prompts[-1:], params, use_tqdm=False)  # its prefix is cached
        tokens[name] = [list(o.outputs[0].token_ids) for o in first + last]
        llm.shutdown()
    assert tokens["torch"] == tokens["cpu"]
