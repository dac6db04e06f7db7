"""One paged-attention kernel for decodes and prefill chunks over cached prefixes.

The batch is the flattened varlen one of CommonAttentionMetadata: request r's query tokens
are rows [qsl[r], qsl[r+1]), the last of its seq_lens[r] keys being its newest token (this
step's K/V are in the cache already), its blocks the row r of an int32 block table. A
program takes a tile of one request: BLOCK_Q consecutive query tokens times the
QUERIES_PER_KV query heads that share one KV head, BLOCK_M rows in all, so the heads of a
group go through one tl.dot per key tile. It walks the keys TILE_N at a time (FP8_TILE_N for
an fp8 cache), reading K/V in place through the block table (each key's block looked up: no
gather into a workspace), with an online softmax in fp32 (in the log2 domain) and a causal
mask within the chunk. A sliding window W (a runtime argument: the launch's shape does not
change with it) masks keys j <= i - W out and starts the walk at the tile holding the tile's
first query's first key; keys before that one are never loaded (their blocks may be freed).

Small decode batches leave most of the GPU idle, so there the keys of each tile are split
into NUM_SPLITS ranges run by separate programs (flash-decoding); each writes its running
max, sum and unnormalized output, and a second kernel combines them per row and head.

Arithmetic is in fp32: bf16/fp16 values are upcast before any of it. The two dots take the
model's dtype on a GPU (tensor cores, fp32 accumulation) and fp32 where the model is fp32
(IEEE, not tf32) or where a bf16 model runs under the interpreter, whose bf16 dot multiplies
raw bits. An fp8 cache under a bf16 model takes fp16 dots on a GPU (see paged_attention).
Under the interpreter the fp32 -> bf16 cast of the output truncates: bf16 outputs are then
within one ulp of the rounded result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

MAX_SPLITS = 16
DECODE_BLOCK_M = 16  # rows of a decode tile: tl.dot's smallest M
PREFILL_BLOCK_M = 64
TILE_N = 64  # keys per iteration
# An fp8 cache's tiles are half the bytes: twice the keys keep as many bytes in flight. On an
# H200 (one layer's decode, 32/8 heads x 128) 128 keys took fp8 0.77-0.95x the time of 64
# (B = 64-256, 1k-8k tokens) and bf16 0.98-1.12x: each dtype keeps its best.
FP8_TILE_N = 128
# The window argument of a layer without one: past any position (an int32 kernel argument).
NO_WINDOW = 2**30


@dataclass(slots=True)
class AttentionLaunch:
    """How one step runs: its tiles (host arrays: the backend puts them on the device) and
    the launch's shape. The shape depends only on the step's query lengths and batch size,
    never on the contexts, so a captured graph of a batch size stays valid for any context."""

    block_m: int
    block_q: int  # query tokens per tile
    num_splits: int
    tile_req: np.ndarray  # int32 [num_tiles]: the request of each tile
    tile_qstart: np.ndarray  # int32 [num_tiles]: its first query token within the request

    @property
    def num_tiles(self) -> int:
        return len(self.tile_req)


def num_splits_for(num_reqs: int, num_kv_heads: int, target_programs: int) -> int:
    """Context splits of a decode-only step: enough programs to fill target_programs."""
    programs = num_reqs * num_kv_heads
    if programs >= target_programs:
        return 1
    return max(1, min(MAX_SPLITS, -(-target_programs // programs)))


def max_split_rows(max_rows: int, num_kv_heads: int, target_programs: int) -> int:
    """The most rows x splits of partial results any decode-only step of up to max_rows
    requests needs (the size of a graph runner's static partial buffers)."""
    return max(n * num_splits_for(n, num_kv_heads, target_programs) for n in range(1, max_rows + 1))


def plan_launch(
    query_lens: np.ndarray,
    queries_per_kv: int,
    num_kv_heads: int,
    target_programs: int,
) -> AttentionLaunch:
    """The tiles of a step whose requests have these query lengths (int64 [num_reqs], in
    flattened-batch order)."""
    num_reqs = len(query_lens)
    decode_only = num_reqs > 0 and int(query_lens.max()) == 1
    group = triton.next_power_of_2(queries_per_kv)
    block_m = max(DECODE_BLOCK_M if decode_only else PREFILL_BLOCK_M, group)
    block_q = block_m // queries_per_kv
    if decode_only:
        tile_req = np.arange(num_reqs, dtype=np.int32)
        tile_qstart = np.zeros(num_reqs, dtype=np.int32)
        splits = num_splits_for(num_reqs, num_kv_heads, target_programs)
    else:
        tiles = -(-query_lens // block_q)
        tile_req = np.repeat(np.arange(num_reqs, dtype=np.int32), tiles)
        first_tile = np.cumsum(tiles) - tiles
        tile_qstart = ((np.arange(len(tile_req)) - first_tile[tile_req]) * block_q).astype(np.int32)
        splits = 1
    return AttentionLaunch(block_m, block_q, splits, tile_req, tile_qstart)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_req_ptr,
    tile_qstart_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,  # float32 [NUM_HEADS] with HAS_SINKS: a logit per head, in every softmax
    qk_scale,  # the softmax scale times log2(e), times the K scale of an fp8 cache
    v_scale,
    window,  # a query at position i attends keys j > i - window (no window: a huge one)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    FP8: tl.constexpr,
    CLAMP_Q: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    q_first = tl.load(tile_qstart_ptr + tile)
    row_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - row_begin
    seq_len = tl.load(seq_lens_ptr + req)
    cached = seq_len - q_len  # keys before this step's chunk

    # Row i of the tile: query token q_first + i // G of the request, head i % G of the group.
    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_first + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_tok < q_len)
    q_pos = cached + q_tok
    rows = (row_begin + q_tok).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if CLAMP_Q:  # a bf16 q for fp16 dots: held to fp16's range, never inf
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)
    q = q.to(DOT_DTYPE)

    # The keys this tile's last query attends, and this split's share of their tiles.
    kv_len = cached + tl.minimum(q_first + BLOCK_Q, q_len)
    # the first key the tile's first query attends: the walk starts at its key tile
    kv_start = tl.maximum(cached + q_first - window + 1, 0)
    first_key_tile = kv_start // TILE
    num_key_tiles = tl.cdiv(kv_len, TILE) - first_key_tile
    per_split = tl.cdiv(num_key_tiles, NUM_SPLITS)
    lo = first_key_tile + split * per_split
    hi = tl.minimum(lo + per_split, first_key_tile + num_key_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    cache_head = kv_head * stride_cache_head
    for j in range(lo, hi):
        keys = j * TILE + tl.arange(0, TILE)
        key_ok = (keys < kv_len) & (keys >= kv_start)
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_token + cache_head
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        ).to(DOT_DTYPE)  # [DIM_PAD, TILE]; e4m3 values are exact in bf16/fp16/fp32
        if DOT_IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * qk_scale
        attend = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        attend = attend & (keys[None, :] > q_pos[:, None] - window)
        s = tl.where(attend, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # [TILE, DIM_PAD]
        if DOT_IEEE:
            pv = tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(DOT_DTYPE), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if FP8:  # p @ (v * v_scale) = (p @ v) * v_scale: one multiply a row, not one a value
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink joins the softmax with no value: only the sum grows
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_all)
            l_i = l_i * alpha + tl.exp2(sink - m_all)
            acc = acc * alpha[:, None]
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no keys (a padding row): zeros
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        part = (rows * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)


@triton.jit
def _combine_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    part = (row * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(part_m_ptr + part, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits: 0
    total = tl.sum(l_s * weight, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_max)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    o = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + row * stride_ot + head * stride_oh + dims,
        o.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def dot_dtype(model_dtype: torch.dtype, device: torch.device):
    """The dots' operand type (see the module's docstring)."""
    if model_dtype == torch.float32 or (model_dtype == torch.bfloat16 and device.type == "cpu"):
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[model_dtype]


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    tile_req: torch.Tensor,
    tile_qstart: torch.Tensor,
    launch: AttentionLaunch,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H, D] = attention of q [T, H, D] over kv_cache [2, blocks, bs, Hkv, D] (an fp8
    cache: values times the scales). block_table int32 [num_reqs, >= blocks of each request]
    (any row stride), seq_lens / query_start_loc int32, tile_req / tile_qstart int32 from
    `launch`. partials: flat fp32 buffers (out, max, sum) of at least T * H * splits * D and
    T * H * splits values, for a split launch; allocated here when not given. window: a
    sliding window (a query at position i attends keys i - window < j <= i); None: none.
    sinks: float32 [H], a logit per head joining every softmax with no value; None: none."""
    t, num_heads, head_dim = q.shape
    if t == 0 or launch.num_tiles == 0:
        return out
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.is_contiguous()
    assert block_table.stride(-1) == 1
    splits = launch.num_splits
    if splits > 1 and partials is None:
        n = t * num_heads * splits
        partials = (
            torch.empty(n * head_dim, dtype=torch.float32, device=q.device),
            torch.empty(n, dtype=torch.float32, device=q.device),
            torch.empty(n, dtype=torch.float32, device=q.device),
        )
    part_out, part_m, part_l = partials if splits > 1 else (out, out, out)  # unread when 1
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    dot = dot_dtype(q.dtype, q.device)
    if fp8 and dot == tl.bfloat16:
        # e4m3 converts to fp16 in one instruction a pair, to bf16 only through fp16: fp16
        # dots skip that second step, and hold q (bf16's 8 bits of mantissa, in fp16's 11)
        # and the probabilities (in [0, 1]) at least as closely as bf16 dots would.
        dot = tl.float16
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    _paged_attention_kernel[(launch.num_tiles, num_kv_heads, splits)](
        out, q, k_cache, v_cache,
        block_table, seq_lens, query_start_loc, tile_req, tile_qstart,
        part_out, part_m, part_l, out if sinks is None else sinks,
        # q . (k * k_scale) = (q . k) * k_scale: the K scale rides on the softmax scale
        float(scale) * (float(k_scale) if fp8 else 1.0) * 1.4426950408889634, float(v_scale),
        NO_WINDOW if window is None else int(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=launch.block_m,
        BLOCK_Q=launch.block_q,
        TILE=FP8_TILE_N if fp8 else TILE_N,
        NUM_SPLITS=splits,
        DOT_DTYPE=dot,
        DOT_IEEE=dot == tl.float32,
        FP8=fp8,
        CLAMP_Q=dot == tl.float16 and q.dtype != torch.float16,
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(t, num_heads)](
            out, part_out, part_m, part_l, out if sinks is None else sinks,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
            HAS_SINKS=sinks is not None,
        )  # fmt: skip
    return out
