"""The Triton kernels (engine.kernels.triton) and the triton backend against the torch
reference, on the same CommonAttentionMetadata.

Without a GPU they run under Triton's interpreter (tests/engine/conftest.py sets
TRITON_INTERPRET=1), so the shapes are tiny. Tolerances against the torch backend: float32
1e-5 (sums in another order); float16 2e-3 (the kernel's P @ V dot takes fp16 operands, as
on a GPU); bfloat16 2^-6 relative (2 ulps: the interpreter's fp32 -> bf16 cast truncates,
one ulp, and the reference rounds its own output once). An fp8 cache is read alike by both
(the same bytes, dequantized exactly; the step's K/V are e4m3 values already, since the torch
path attends a fresh prompt's own K/V rather than the cache), so the tolerances stay those of
the model's dtype.
On a GPU machine the same tests run the compiled kernels on CUDA tensors (DEVICE), and the
`cuda` tests run them at real shapes, only where a GPU is.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from engine.args import EngineArgs
from engine.attention import kv_fp8  # noqa: E402
from engine.attention.backends import select_backend  # noqa: E402
from engine.attention.backends.torch import TorchAttentionBackend  # noqa: E402
from engine.attention.backends.triton import TritonAttentionBackend  # noqa: E402
from engine.attention.layer import PagedAttention  # noqa: E402
from engine.attention.metadata import PAD_SLOT_ID, common_metadata_from_seqs  # noqa: E402
from engine.kernels import triton as kernels  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 2**-6},
}
GQA = [(2, 2), (8, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 4, 8
NUM_BLOCKS = 160


def _step(scenario: str, bs: int, seed: int = 0) -> list[tuple[int, int, list[int]]]:
    """(start_pos, num_tokens, block_ids) per request, decodes first by context; blocks drawn
    from a shuffled pool (holes, out of order), a spare block on some requests, contexts
    that are no multiple of the block size and longer than one key tile (64)."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)

    def blocks(ctx: int, spare: int = 0) -> list[int]:
        return [free.pop() for _ in range(-(-ctx // bs) + spare)]

    num_decodes = {"decode": 6, "prefix": 2, "mixed": 5}[scenario]
    ctx = sorted(rng.randint(1, 150) for _ in range(num_decodes))
    seqs = [(c - 1, 1, blocks(c, spare=i % 2)) for i, c in enumerate(ctx)]
    if scenario in ("prefix", "mixed"):  # chunks on cached prefixes: block-aligned and not
        seqs += [(2 * bs, 9, blocks(2 * bs + 9)), (bs + 5, 70, blocks(bs + 75))]
    if scenario == "mixed":  # and a fresh prompt
        seqs.append((0, 23, blocks(23)))
    return seqs


def _inputs(seqs, heads, kv_heads, d, bs, dtype, fp8, seed=0, kv_scales=(1.0, 1.0), mag=1.0):
    """cache, q, k, v; with fp8, K and V of magnitude mag stored with kv_scales."""
    g = torch.Generator().manual_seed(seed)
    t = sum(n for _, n, _ in seqs)
    full = torch.randn(2, NUM_BLOCKS, bs, kv_heads, d, generator=g)
    cache = full.to(dtype)
    if fp8:
        cache = torch.stack([kv_fp8.quantize(full[i] * mag, kv_scales[i]) for i in (0, 1)])
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    if fp8:  # e4m3 values: the torch path attends a fresh prompt's own K/V, not the cache's
        k, v = (
            kv_fp8.dequantize(kv_fp8.quantize(x * mag, s), s, dtype)
            for x, s in zip((k, v), kv_scales, strict=True)
        )
    return tuple(x.to(DEVICE) for x in (cache, q, k, v))


def _attend(backend, cache, q, k, v, meta, window=None, sinks=None, kv_scales=(1.0, 1.0)):
    """Through the layer: write this step's K/V, then attend. -> (out [T, H*D], the cache)."""
    _, _, bs, kv_heads, d = cache.shape
    attn = PagedAttention(q.shape[1], kv_heads, d, d**-0.5, window, sinks=sinks is not None)
    attn.k_scale, attn.v_scale = kv_scales
    if sinks is not None:
        attn.sinks.data.copy_(sinks)
    attn.kv_cache, attn.backend = cache.clone(), backend
    if cache.dtype == kv_fp8.FP8_DTYPE:
        attn.kv_spec = kv_fp8.Fp8KVCacheSpec(bs, kv_heads, d, q.dtype)
    with torch.inference_mode():
        return attn(q, k, v, meta), attn.kv_cache


def _split_backend(bs, heads, kv_heads, d, dtype, splits: int, num_seqs: int):
    """The triton backend aiming its decodes at `splits` context splits (1: its own plan)."""
    target = splits * num_seqs * kv_heads if splits > 1 else None
    return TritonAttentionBackend(
        bs, heads, kv_heads, d, dtype, DEVICE, split_target_programs=target
    )


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype == kv_fp8.FP8_DTYPE else cache


def _check_against_torch(seqs, heads, kv_heads, d, bs, dtype, fp8, **triton_kwargs):
    """The triton backend and the torch one on the same step: the same cache after the
    write, outputs within the dtype's tolerance. -> the triton metadata."""
    cache, q, k, v = _inputs(seqs, heads, kv_heads, d, bs, dtype, fp8)
    common = common_metadata_from_seqs(seqs, bs)
    ref_backend = TorchAttentionBackend(bs, heads, kv_heads, d, dtype, device=DEVICE)
    backend = TritonAttentionBackend(bs, heads, kv_heads, d, dtype, DEVICE, **triton_kwargs)
    meta = backend.build_metadata(common)
    ref, ref_cache = _attend(ref_backend, cache, q, k, v, ref_backend.build_metadata(common))
    out, out_cache = _attend(backend, cache, q, k, v, meta)
    assert torch.equal(_bytes(out_cache), _bytes(ref_cache))
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    return meta


# -- the store --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,fp8",
    [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False),
     (torch.bfloat16, True), (torch.float16, True), (torch.float32, True)],
)  # fmt: skip
def test_store_kv_writes_what_torch_writes_and_padding_writes_nowhere(dtype, fp8):
    """store_kv through the slot mapping: the bytes of the torch reference's write (fp8: the
    same rounding and saturation), from strided K/V views; PAD_SLOT_ID rows write nothing."""
    bs, hkv, d = 8, 3, 24  # neither a power of two
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 12, bs, hkv, d, generator=g)
    cache = kv_fp8.quantize(cache, 1.0) if fp8 else cache.to(dtype)
    t = 11
    qkv = torch.randn(t, 4 * hkv, d, generator=g) * 100  # some beyond +-448
    # e4m3's edges: zero, subnormals and a subnormal tie, the smallest normal's neighbours,
    # ties to even (1.0625 -> 1, 1.1875 -> 1.25), a carry into the exponent, saturation
    edges = [0.0, 2**-10, 3 * 2**-10, 2**-9, 0.0155, 2**-6, 1.0625, 1.1875, 1.96875, 1.99]
    edges += [448.0, 460.0, 1e4, -(2**-8), -1.0625, -500.0]
    special = torch.tensor(edges)
    qkv[0, hkv:] = special.repeat(-(-(3 * hkv * d) // len(edges)))[: 3 * hkv * d].view(3 * hkv, d)
    qkv, cache = qkv.to(dtype).to(DEVICE), cache.to(DEVICE)
    k, v = qkv[:, hkv : 2 * hkv], qkv[:, 3 * hkv :]  # strided views, as a fused QKV gives
    slots = torch.randperm(12 * bs, generator=g)[:t].clone()
    slots[[2, 7]] = PAD_SLOT_ID
    slots = slots.to(DEVICE)
    ref = cache.clone()
    keep = slots >= 0
    if fp8:
        kv_fp8.write(ref, slots[keep], k[keep], v[keep])
    else:
        flat = ref.view(2, -1, hkv, d)
        flat[0][slots[keep]] = k[keep]
        flat[1][slots[keep]] = v[keep]
    out = cache.clone()
    kernels.store_kv(k, v, out, slots, kv_fp8.K_SCALE, kv_fp8.V_SCALE)
    assert torch.equal(_bytes(out), _bytes(ref))
    assert not torch.equal(_bytes(out), _bytes(cache))  # it did write


# -- attention ---------------------------------------------------------------------------


CASES = [(torch.bfloat16, "decode"), (torch.bfloat16, "mixed"), (torch.float16, "mixed")]
CASES = [(*case, *g) for case in [*CASES, (torch.float32, "mixed")] for g in GQA]
CASES.append((torch.bfloat16, "prefix", 8, 1))


@pytest.mark.parametrize("dtype,scenario,heads,kv_heads", CASES)
def test_backend_matches_torch_reference(dtype, scenario, heads, kv_heads):
    """Decodes only; a mixed step: decodes, prefill chunks on cached prefixes (one over
    several query tiles) and a fresh prompt; chunks alone; GQA 1/4/8; block size 16, head
    dim 32; every dtype."""
    seqs = _step(scenario, 16, seed=heads + kv_heads)
    meta = _check_against_torch(seqs, heads, kv_heads, 32, 16, dtype, False)
    if not HAS_CUDA:  # the interpreter's default: no split (a GPU splits to fill its SMs)
        assert meta.launch.num_splits == 1


@pytest.mark.parametrize(
    "dtype,heads,kv_heads",
    [(torch.bfloat16, *g) for g in GQA] + [(torch.float16, 8, 2)],
)
def test_fp8_cache_matches_torch_reference(dtype, heads, kv_heads):
    """An fp8 e4m3 cache, block size 8, head dim 24 (padded to 32 in the kernel): the
    kernel's store and the torch quantizer write the same bytes, and both attend alike."""
    _check_against_torch(_step("mixed", 8, seed=3), heads, kv_heads, 24, 8, dtype, True)


@pytest.mark.parametrize("scenario", ["mixed", "decode"])
def test_fp8_cache_under_a_bf16_model_on_fp16_dots(monkeypatch, scenario):
    """A GPU gives a bf16 model bf16 dots, and an fp8 cache under it fp16 dots (q held to
    fp16's range): that choice made here too (the interpreter would take float32 dots), the
    kernel still attends like the torch reference, one q row past fp16's range included."""
    module = sys.modules["engine.kernels.triton.paged_attention"]
    choice = module.dot_dtype
    monkeypatch.setattr(
        module,
        "dot_dtype",
        lambda dt, dev: tl.bfloat16 if dt == torch.bfloat16 else choice(dt, dev),
    )
    heads, kv_heads, d, bs = 8, 2, 32, 16
    seqs = _step(scenario, bs, seed=9)
    cache, q, k, v = _inputs(seqs, heads, kv_heads, d, bs, torch.bfloat16, True)
    q[0, 0] = 1e5  # beyond fp16's 65,504: clamped, so the row stays finite
    common = common_metadata_from_seqs(seqs, bs)
    ref_backend = TorchAttentionBackend(bs, heads, kv_heads, d, torch.bfloat16, device=DEVICE)
    backend = TritonAttentionBackend(bs, heads, kv_heads, d, torch.bfloat16, DEVICE)
    ref, _ = _attend(ref_backend, cache, q, k, v, ref_backend.build_metadata(common))
    out, _ = _attend(backend, cache, q, k, v, backend.build_metadata(common))
    assert bool(torch.isfinite(out.float()).all())
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_scales_read_as_the_values_they_scale(splits):
    """An fp8 cache read with K/V scales 2 and 0.5 attends like a float32 cache holding those
    e4m3 values times the scales (the kernel folds K's scale into the softmax scale and V's
    into the output), on a mixed step and a split decode step."""
    heads, kv_heads, d, bs = 8, 2, 32, 16
    scenario = "mixed" if splits == 1 else "decode"
    seqs = _step(scenario, bs, seed=6)
    cache, q, _, _ = _inputs(seqs, heads, kv_heads, d, bs, torch.float32, True)
    scaled = torch.stack([kv_fp8.dequantize(cache[0], 2.0, torch.float32),
                          kv_fp8.dequantize(cache[1], 0.5, torch.float32)])  # fmt: skip
    backend = _split_backend(bs, heads, kv_heads, d, torch.float32, splits, len(seqs))
    meta = backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    assert meta.launch.num_splits == splits
    outs = []
    for kv, (k_scale, v_scale) in ((cache, (2.0, 0.5)), (scaled, (1.0, 1.0))):
        out = torch.empty_like(q)
        kernels.paged_attention(
            out, q, kv, meta.block_table, meta.seq_lens, meta.query_start_loc,
            meta.tile_req, meta.tile_qstart, meta.launch, d**-0.5, k_scale, v_scale,
        )  # fmt: skip
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], **TOL[torch.float32])


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("fp8", [False, True], ids=["kv-bf16", "kv-fp8"])
def test_split_context_matches_torch_reference(heads, kv_heads, fp8):
    """A small decode batch split along its contexts (flash-decoding): partial results of
    every split, empty ones included (4 splits of 1-3 key tiles), combined per row."""
    seqs = _step("decode", 16, seed=5)
    target = 4 * len(seqs) * kv_heads
    meta = _check_against_torch(
        seqs, heads, kv_heads, 32, 16, torch.bfloat16, fp8, split_target_programs=target
    )
    assert meta.launch.num_splits == 4


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_cache_with_a_checkpoints_scales_matches_torch_reference(splits):
    """Per-layer K/V scales (an FP8-KV checkpoint's): the kernels store K / k_scale and
    read q * scale as the torch reference does (the same bytes, outputs within bf16's
    tolerance), decodes split or not and a mixed step. K of magnitude ~600 (past e4m3's 448)
    keeps its values with k_scale 4 where scale 1 saturates it; V's small scale keeps its
    resolution."""
    heads, kv_heads, d, bs, scales = 8, 2, 32, 16, (4.0, 0.0625)
    for scenario in ("decode", "mixed"):
        seqs = _step(scenario, bs, seed=11)
        cache, q, k, v = _inputs(seqs, heads, kv_heads, d, bs, torch.bfloat16, True, 0,
                                 kv_scales=scales, mag=200.0)  # fmt: skip
        common = common_metadata_from_seqs(seqs, bs)
        ref_backend = TorchAttentionBackend(bs, heads, kv_heads, d, torch.bfloat16, DEVICE)
        backend = _split_backend(bs, heads, kv_heads, d, torch.bfloat16, splits, len(seqs))
        meta = backend.build_metadata(common)
        ref_meta = ref_backend.build_metadata(common)
        ref, ref_cache = _attend(ref_backend, cache, q, k, v, ref_meta, kv_scales=scales)
        out, out_cache = _attend(backend, cache, q, k, v, meta, kv_scales=scales)
        assert torch.equal(_bytes(out_cache), _bytes(ref_cache))
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
        # what the scales bought: this step's K read back within e4m3's rounding; at scale
        # 1.0 the same K saturates at 448
        slots = common.slot_mapping.to(DEVICE)
        stored = out_cache[0].view(-1, kv_heads, d)[slots].float() * scales[0]
        assert (k.float().abs() > 448).any()
        torch.testing.assert_close(stored, k.float(), rtol=2**-4, atol=0.0)
        unscaled = kv_fp8.quantize(k, 1.0).float()
        assert unscaled.abs().max() == 448


def test_split_and_unsplit_launches_agree():
    """The same decode step with 1, 3 and 16 (the most) splits: float32, within summation
    order."""
    seqs = _step("decode", 16, seed=9)[-3:]
    heads, kv_heads, d, bs = 8, 2, 32, 16
    cache, q, k, v = _inputs(seqs, heads, kv_heads, d, bs, torch.float32, False)
    common = common_metadata_from_seqs(seqs, bs)
    outs = []
    for target in (1, 3 * len(seqs) * kv_heads, 10**6):
        backend = TritonAttentionBackend(
            bs, heads, kv_heads, d, torch.float32, DEVICE, split_target_programs=target
        )
        meta = backend.build_metadata(common)
        outs.append((meta.launch.num_splits, _attend(backend, cache, q, k, v, meta)[0]))
    assert [s for s, _ in outs] == [1, 3, kernels.MAX_SPLITS]
    for _, out in outs[1:]:
        torch.testing.assert_close(out, outs[0][1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [1, 7, 16, 70])  # 70: past a key tile
@pytest.mark.parametrize(
    "scenario,dtype,splits",
    [("mixed", torch.float32, 1), ("prefix", torch.bfloat16, 1), ("decode", torch.float32, 4)],
)
def test_sliding_window_matches_torch_reference(window, scenario, dtype, splits):
    """A layer's sliding window (keys i - W < j <= i): decodes past it (split along their
    contexts too), chunks across its edge over several query tiles, a fresh prompt longer
    than it. The blocks wholly before a request's window are freed (the null block in its
    table) or poisoned with NaN: the kernel never loads them."""
    heads, kv_heads, d, bs = 8, 2, 32, 16
    seqs = _step(scenario, bs, seed=window)
    cache, q, k, v = _inputs(seqs, heads, kv_heads, d, bs, dtype, False)
    dropped = []
    for r, (start, n, ids) in enumerate(seqs):  # as the KV cache manager frees them
        gone = max(0, start - window + 1) // bs
        dropped += ids[:gone]
        if r % 2 == 0:
            seqs[r] = (start, n, [0] * gone + ids[gone:])
    assert dropped
    cache[:, dropped] = float("nan")
    common = common_metadata_from_seqs(seqs, bs)
    ref_backend = TorchAttentionBackend(bs, heads, kv_heads, d, dtype, device=DEVICE)
    backend = _split_backend(bs, heads, kv_heads, d, dtype, splits, len(seqs))
    meta = backend.build_metadata(common)
    assert meta.launch.num_splits == splits
    ref_meta = ref_backend.build_metadata(common)
    ref, _ = _attend(ref_backend, cache, q, k, v, ref_meta, window)
    out, _ = _attend(backend, cache, q, k, v, meta, window)
    assert bool(torch.isfinite(out.float()).all()) and bool(torch.isfinite(ref.float()).all())
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_plan_launch_covers_every_query_token_once():
    """The tiles: decodes one per request; a chunk's tokens in tiles of block_q; every
    (token, head) row in exactly one tile; split counts fall as the batch grows."""
    qlens = np.array([1, 1, 1, 9, 70, 23])
    for g in (1, 4, 8, 32):
        launch = kernels.plan_launch(qlens, g, 2, 64)
        assert launch.block_m == max(64, g) and launch.block_q == launch.block_m // g
        covered = np.zeros(int(qlens.sum()), dtype=int)
        starts = np.concatenate([[0], np.cumsum(qlens)[:-1]])
        for r, q0 in zip(launch.tile_req, launch.tile_qstart, strict=True):
            end = min(q0 + launch.block_q, qlens[r])
            covered[starts[r] + q0 : starts[r] + end] += 1
        assert (covered == 1).all() and launch.num_splits == 1
    decode = kernels.plan_launch(np.ones(3, dtype=np.int64), 4, 2, 64)
    assert decode.block_m == 16 and decode.tile_req.tolist() == [0, 1, 2]
    assert decode.num_splits == 11  # ceil(64 / (3 * 2))
    assert kernels.plan_launch(np.ones(40, dtype=np.int64), 4, 2, 64).num_splits == 1
    assert kernels.max_split_rows(40, 2, 64) == max(
        n * kernels.plan_launch(np.ones(n, dtype=np.int64), 4, 2, 64).num_splits
        for n in range(1, 41)
    )


def test_static_buffers_give_what_fresh_metadata_gives():
    """A graph runner's hooks: buffers for a maximum batch, filled in place step after step
    (a split decode batch, a mixed step, a smaller decode batch), give bit for bit the output
    of fresh metadata, and the tensors the kernels read are views of those buffers."""
    heads, kv_heads, d, bs = 8, 2, 32, 16
    backend = TritonAttentionBackend(
        bs, heads, kv_heads, d, torch.bfloat16, DEVICE, split_target_programs=24
    )
    static = backend.allocate_static_metadata(max_rows=128, max_blocks_per_req=12)
    fields = ("slot_mapping", "query_start_loc", "seq_lens", "tile_req", "tile_qstart")
    splits = []
    for seed, scenario in enumerate(["decode", "mixed", "decode"]):
        seqs = _step(scenario, bs, seed)
        if seed == 2:
            seqs = seqs[:3]
        cache, q, k, v = _inputs(seqs, heads, kv_heads, d, bs, torch.bfloat16, False, seed)
        common = common_metadata_from_seqs(seqs, bs)
        fresh = backend.build_metadata(common)
        meta = backend.fill_static_metadata(static, common)
        for name in fields:
            assert torch.equal(getattr(meta, name), getattr(fresh, name)), name
            assert getattr(meta, name).data_ptr() == getattr(static, name).data_ptr(), name
        assert torch.equal(meta.block_table, fresh.block_table)
        assert meta.block_table.data_ptr() == static.block_table.data_ptr()
        assert meta.block_table.stride(0) == 12  # the static width, whatever the step's
        assert meta.launch.num_splits == fresh.launch.num_splits
        if meta.partials is not None:
            assert meta.partials[0].data_ptr() == static.partials[0].data_ptr()
        splits.append(meta.launch.num_splits)
        fresh_out, fresh_cache = _attend(backend, cache, q, k, v, fresh)
        out, out_cache = _attend(backend, cache, q, k, v, meta)
        assert torch.equal(out, fresh_out) and torch.equal(out_cache, fresh_cache)
    assert splits == [2, 1, 4]  # ceil(24 / (6 * 2)), a mixed step, ceil(24 / (3 * 2))
    too_long = [(12 * bs, 1, list(range(1, 14)))]  # 13 blocks: one more than the buffers hold
    with pytest.raises(ValueError, match="does not fit static buffers"):
        backend.fill_static_metadata(static, common_metadata_from_seqs(too_long, bs))


def test_padded_decode_batch_gives_the_unpadded_rows():
    """A decode batch padded as a graph runner pads it: extra requests of one token with
    slot PAD_SLOT_ID and no keys. The real rows are bit for bit the unpadded batch's, the
    padding rows are zeros, and the cache holds only the real requests' K/V."""
    heads, kv_heads, d, bs = 8, 2, 32, 16
    seqs = _step("decode", bs, seed=4)
    n, pad = len(seqs), 3
    padded = common_metadata_from_seqs([*seqs, *[(0, 1, [0])] * pad], bs)
    seq_lens = padded.seq_lens_np.copy()
    seq_lens[n:] = 0
    slots = padded.slot_mapping.clone()
    slots[n:] = PAD_SLOT_ID
    padded = dataclasses.replace(
        padded,
        slot_mapping=slots,
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        seq_lens_np=seq_lens,
    )
    cache, q, k, v = _inputs(
        [*seqs, *[(0, 1, [0])] * pad], heads, kv_heads, d, bs, torch.bfloat16, False
    )
    backend = TritonAttentionBackend(bs, heads, kv_heads, d, torch.bfloat16, DEVICE)
    common = common_metadata_from_seqs(seqs, bs)
    out, out_cache = _attend(backend, cache, q[:n], k[:n], v[:n], backend.build_metadata(common))
    padded_out, padded_cache = _attend(backend, cache, q, k, v, backend.build_metadata(padded))
    assert torch.equal(padded_out[:n], out) and not padded_out[n:].any()
    assert torch.equal(padded_cache, out_cache)


@pytest.mark.parametrize(
    "scenario,dtype,splits,window,fp8",
    [("mixed", torch.float32, 1, None, False), ("decode", torch.float32, 4, None, False),
     ("prefix", torch.bfloat16, 1, 7, False), ("decode", torch.bfloat16, 3, 16, True)],
)  # fmt: skip
def test_sinks_match_torch_reference(scenario, dtype, splits, window, fp8):
    """Attention sinks (gpt-oss): in the one-pass kernel's last step and in the split
    combine, with windows and an fp8 cache; some sinks dominate their heads, some vanish."""
    heads, kv_heads, d, bs = 8, 2, 32, 16
    seqs = _step(scenario, bs, seed=3)
    cache, q, k, v = _inputs(seqs, heads, kv_heads, d, bs, dtype, fp8)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(5)) * 2
    sinks[0], sinks[-1] = 6.0, -30.0
    sinks = sinks.to(DEVICE)
    common = common_metadata_from_seqs(seqs, bs)
    ref_backend = TorchAttentionBackend(bs, heads, kv_heads, d, dtype, device=DEVICE)
    backend = _split_backend(bs, heads, kv_heads, d, dtype, splits, len(seqs))
    meta = backend.build_metadata(common)
    assert meta.launch.num_splits == splits
    ref_meta = ref_backend.build_metadata(common)
    ref, _ = _attend(ref_backend, cache, q, k, v, ref_meta, window, sinks)
    out, _ = _attend(backend, cache, q, k, v, meta, window, sinks)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    plain, _ = _attend(ref_backend, cache, q, k, v, ref_backend.build_metadata(common), window)
    assert (plain.float() - ref.float()).abs().max() > 0.05  # the sinks changed the output


@pytest.mark.parametrize("window", [None, 4])
def test_forward_without_a_cache_is_causal_attention(window):
    """Before the KV cache is sized (the runner's profile run) a prompt attends causally to
    its own K/V (within a layer's sliding window), as the torch backend does then."""
    seqs = [(0, 5, [1]), (0, 9, [2])]
    common = common_metadata_from_seqs(seqs, 16)
    _, q, k, v = _inputs(seqs, 8, 2, 16, 16, torch.float32, False)
    attn = PagedAttention(8, 2, 16, 0.25, sliding_window=window)
    outs = []
    for backend in (TorchAttentionBackend(16, 8, 2, 16, torch.float32),
                    TritonAttentionBackend(16, 8, 2, 16, torch.float32)):  # fmt: skip
        attn.backend = backend
        outs.append(attn(q, k, v, backend.build_metadata(common)))
    torch.testing.assert_close(outs[1], outs[0])


# -- selection, config, sizing -----------------------------------------------------------


def test_selection_config_and_fp8_errors():
    cuda = torch.device("cuda")
    auto = select_backend("auto", cuda, torch.bfloat16, "auto", 8, 128)
    assert auto.backend is TritonAttentionBackend and auto.reason.startswith("auto: triton")
    assert select_backend("triton", cuda, torch.float16, "fp8", 8, 128).reason
    with pytest.raises(ValueError, match="'triton' cannot run this model: .*CUDA"):
        select_backend("triton", "cpu", torch.float32, "auto", 2, 16)
    with pytest.raises(
        ValueError, match="do not read a KV cache of dtype int8 .they read auto, fp8"
    ):
        select_backend("triton", cuda, torch.bfloat16, "int8", 8, 128)
    with pytest.raises(ValueError, match="no attention backend .*fp8 KV cache is served by"):
        select_backend("auto", "cpu", torch.bfloat16, "fp8", 8, 128)
    for backend, device in (("torch", "auto"), ("cpu", "auto"), ("auto", "cpu")):
        with pytest.raises(ValueError, match="fp8 needs the triton attention backend"):
            EngineArgs(
                kv_cache_dtype="fp8", attention_backend=backend, device=device
            ).create_engine_config()
    config = EngineArgs(kv_cache_dtype="fp8", device="cuda").create_engine_config()
    assert config.cache.kv_cache_dtype == "fp8"


def test_fp8_blocks_take_half_the_bytes_of_bf16(tiny_llama_dir):
    from engine.worker.model_runner import ModelRunner

    config = EngineArgs(model=str(tiny_llama_dir), max_model_len=64).create_engine_config()
    runner = ModelRunner(config, tiny_llama_dir)
    # what load_model sets: the backend, whose KV cache spec is all kv_block_bytes reads
    c, bf16 = runner.hf_config, torch.bfloat16
    runner.dtype = bf16
    runner.attn_backend = TorchAttentionBackend(
        runner.block_size, c.num_attention_heads, runner.num_kv_heads, c.head_dim, bf16
    )
    bf16 = runner.kv_block_bytes()
    runner.config.cache.kv_cache_dtype = "fp8"
    assert runner.kv_block_bytes() * 2 == bf16


def test_engine_imports_without_triton_or_gguf():
    """The engine, the registry and the triton backend's module import without triton (made
    unimportable, as if not installed: torch imports it itself where a GPU is), and the
    kernels' module is imported only once the backend is built: a CPU install never needs it.
    Nor does a model that is no GGUF file need gguf-py (a GPU machine's image may lack it)."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['gguf'] = None; "
        "import engine.worker.model_runner, engine.worker.multiproc; "
        "import engine, engine.llm, engine.attention.backends.triton; "
        "from engine.attention.backends import backend_class; "
        "assert backend_class('triton').__name__ == 'TritonAttentionBackend'; "
        "assert 'engine.kernels.triton' not in sys.modules, 'the kernels were imported'"
    )
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root)


# -- on a GPU: real shapes ---------------------------------------------------------------


def _exact_rows(cache, q, seqs, dequant) -> torch.Tensor:
    """float64 attention of every query row over the cache (dequantized), request by request."""
    kv_heads, d = cache.shape[-2:]
    heads, rows, row = q.shape[1], [], 0
    for start, n, ids in seqs:
        keys = dequant(cache[0][list(ids)]).reshape(-1, kv_heads, d).double()
        values = dequant(cache[1][list(ids)]).reshape(-1, kv_heads, d).double()
        ctx = start + n
        qg = q[row : row + n].double().view(n, kv_heads, heads // kv_heads, d)
        scores = torch.einsum("nhgd,lhd->nhgl", qg, keys[:ctx]) * d**-0.5
        pos = torch.arange(start, ctx, device=q.device)
        causal = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~causal[:, None, None, :], float("-inf"))
        rows.append(torch.einsum("nhgl,lhd->nhgd", scores.softmax(-1), values[:ctx]))
        row += n
    return torch.cat(rows).reshape(row, -1)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["kv-bf16", "kv-fp8"])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_kernels_at_real_shapes_cuda(batch, fp8):
    """32 query / 8 KV heads, head dim 128, block size 16, contexts 1, 17, 1000 and 4097
    (decodes, split where the batch is small), and a 300-token chunk on a 1000-token prefix;
    against float64 attention over the same cache: the worst error no more than bf16's."""
    heads, kv_heads, d, bs = 32, 8, 128, 16
    rng = random.Random(batch)
    contexts = [rng.choice([1, 17, 1000, 4097]) for _ in range(batch)]
    contexts[0] = 4097
    num_blocks = sum(-(-c // bs) for c in contexts) + -(-1300 // bs) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    seqs = [(c - 1, 1, [free.pop() for _ in range(-(-c // bs))]) for c in sorted(contexts)]
    seqs.append((1000, 300, [free.pop() for _ in range(-(-1300 // bs))]))
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    full = torch.randn(2, num_blocks, bs, kv_heads, d, device="cuda", generator=g)
    cache = kv_fp8.quantize(full, 1.0) if fp8 else full.to(dtype)
    t = sum(n for _, n, _ in seqs)
    q, k, v = (
        torch.randn(t, h, d, device="cuda", generator=g).to(dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    common = common_metadata_from_seqs(seqs, bs)
    for decode_only in (True, False):  # the decodes alone (may split), then the mixed step
        step = seqs[:-1] if decode_only else seqs
        c = common_metadata_from_seqs(step, bs) if decode_only else common
        backend = TritonAttentionBackend(bs, heads, kv_heads, d, dtype, device="cuda")
        rows = sum(n for _, n, _ in step)
        out, written = _attend(
            backend, cache, q[:rows], k[:rows], v[:rows], backend.build_metadata(c)
        )
        exact = _exact_rows(written, q[:rows], step, lambda x: x.float())
        err = (out.double() - exact).abs().max().item()
        assert err < 2e-2, f"worst error {err}"


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_on_triton_cuda(tiny_llama_dir, kv_cache_dtype):
    """The engine on CUDA: `auto` picks triton; float32 greedy tokens equal the torch
    backend's (prefix hits and chunked prefill included); an fp8 cache serves too."""
    from engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 200, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 40)]
    prompts += [shared + [5, 6, 7], shared + [9] * 11]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    names = ("auto", "torch") if kv_cache_dtype == "auto" else ("auto",)
    for name in names:
        llm = LLM(
            str(tiny_llama_dir), dtype="float32", device="cuda", attention_backend=name,
            kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32, num_kv_blocks=64,
        )  # fmt: skip
        assert llm.engine.executor.runner.attn_backend.name == (
            "triton" if name == "auto" else name
        )
        first = llm.generate(prompts[:-1], params, use_tqdm=False)
        last = llm.generate(prompts[-1:], params, use_tqdm=False)  # its prefix is cached
        tokens[name] = [list(o.outputs[0].token_ids) for o in first + last]
        llm.shutdown()
    assert all(len(t) == 12 for t in tokens["auto"])
    if kv_cache_dtype == "auto":
        assert tokens["auto"] == tokens["torch"]
