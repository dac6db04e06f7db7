"""An optional compiled CPU kernel for decode attention, read straight from the paged cache.

The torch path (backends/torch.py) gathers each decode sequence's blocks into a padded buffer and
runs SDPA: it moves the K/V three times (read, write, read again). This kernel reads each
token's K and V once, which is what bounds decode at large batches on CPU. On CPUs with
AVX512-BF16 a vectorised bf16 variant runs (2x the generic loops in a cached micro-benchmark,
1.3x with the cache in DRAM, where scattered 6 KB blocks bound it). It is plain C
(engine/kernels/cpu/paged_attention.c), built once per machine. Without a compiler, or with
TESSERA_CPU_KERNELS=0, the torch path runs.
The torch path stays the reference: tests check this kernel against it.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu import ops

_MAX_ROW = ops.ATTN_MAX_ROW  # floats in the kernel's per-token row buffer: kv heads * head_dim
_SUPPORTED = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the C functions' suffixes


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (no compiler, build failure, or disabled)."""
    return ops.library()


def kernel_supports(
    dtype: torch.dtype, device: torch.device, num_kv_heads: int, head_dim: int
) -> bool:
    return (
        device.type == "cpu"
        and dtype in _SUPPORTED
        and num_kv_heads * head_dim <= _MAX_ROW
        and load_kernel() is not None
    )


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scratch: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """out/q [n, H, D] (rows may be strided, heads contiguous), caches [blocks, bs, Hkv, D]
    contiguous (an int8 cache tiled inside blocks, engine.attention.kv_int8), block_tables
    [n, max_blocks] int64, context_lens [n] int64, scratch float32
    [threads, size] (one row per thread; see the C source for the size). An int8 cache comes
    with its scales, float32 [blocks, Hkv, bs] each (engine.attention.kv_int8). window: a
    sliding window, each row attending only its last `window` keys; the blocks before the
    one holding the first of them are never read (a freed block's entry may be anything).
    sinks: float32 [H] contiguous, a logit per query head that joins every row's softmax
    with no value (gpt-oss's attention sinks); None: none."""
    lib = load_kernel()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is unavailable (see kernel_supports)")
    n, h, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and out.stride(2) == 1 and out.stride(1) == d
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    assert scratch.is_contiguous() and scratch.dtype == torch.float32
    fn = f"paged_decode_{_SUPPORTED[q.dtype]}"
    ks = vs = 0
    if k_cache.dtype == torch.int8:
        assert k_scales is not None and v_scales is not None
        assert k_scales.is_contiguous() and v_scales.is_contiguous()
        fn, ks, vs = (
            f"paged_decode_kv8_{_SUPPORTED[q.dtype]}",
            k_scales.data_ptr(),
            v_scales.data_ptr(),
        )
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == h
    getattr(lib, fn)(
        out.data_ptr(), out.stride(0), q.data_ptr(), q.stride(0),
        k_cache.data_ptr(), v_cache.data_ptr(), ks, vs, block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), n, h, k_cache.shape[2], d,
        k_cache.shape[1], window or 0, scale, 0 if sinks is None else sinks.data_ptr(),
        scratch.data_ptr(), scratch.shape[1], scratch.shape[0],
    )  # fmt: skip


def write_kv_int8(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Quantize k/v [T, Hkv, D] (rows may be strided, heads contiguous) into the int8 cache at
    their slots: the C version of engine.attention.kv_int8.write."""
    lib = load_kernel()
    assert lib is not None, "the CPU attention kernel is unavailable (see kernel_supports)"
    t, hkv, d = k.shape
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == d and x.dtype in _SUPPORTED
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    getattr(lib, f"kv8_write_{_SUPPORTED[k.dtype]}")(
        k_cache.data_ptr(), v_cache.data_ptr(), k_scales.data_ptr(), v_scales.data_ptr(),
        slot_mapping.data_ptr(), t, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        hkv, d, k_cache.shape[1],
    )  # fmt: skip


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k/v [T, Hkv, D] (rows may be strided, heads contiguous) into a cache in their dtype,
    [blocks, bs, Hkv, D] contiguous, at their flat slots: index_copy_'s result, row copies."""
    lib = load_kernel()
    assert lib is not None, "the CPU attention kernel is unavailable (see kernel_supports)"
    t, hkv, d = k.shape
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == d and x.dtype == k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert k_cache.shape[-2:] == (hkv, d) and len(slot_mapping) == t
    lib.kv_write(
        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), t, k.data_ptr(),
        k.stride(0), v.data_ptr(), v.stride(0), hkv * d * k.element_size(), k.element_size(),
    )  # fmt: skip
