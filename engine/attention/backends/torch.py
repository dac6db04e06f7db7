"""The torch backend: dense gather + SDPA, any device; the reference for every faster backend.

Decodes are split into a few groups of similar length so that padding to the longest
context stays small; each group is one gather + one attention call per layer, whatever its
size. Each prefill chunk is one SDPA call: causal over its own fresh K/V when it starts at
position 0, else over its gathered prefix and itself under a mask.

A layer with a sliding window W (layer.sliding_window) attends only keys i - W < j <= i. The
step's metadata is built once without a window; a windowed layer's variant is built from the
same common metadata the first time a layer of that window asks (metadata.for_window), then
shared by the others: each sequence gathers from the block holding its first key in the
window (the blocks before it may be freed: engine.core.kv_cache_manager), masked to the window.

A layer with attention sinks (gpt-oss: a logit per head in every softmax, with no value) runs
attend_with_sinks instead of SDPA: the same scores and masks, the sink joining each row's
softmax as one more column that is then dropped (transformers' eager attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backends.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionMetadata,
    check_static_capacity,
)
from engine.attention.kv_spec import KVCacheSpec
from engine.attention.metadata import CommonAttentionMetadata


def attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """softmax([q k^T * scale + mask, sink]) without its sink column, times v: q [B, Hq, Q, D],
    k/v [B, Hk, L, D] (Hq a multiple of Hk: grouped-query heads share a KV head), mask None
    (causal, the queries being the last Q of the L positions), bool (True: attend) or
    additive, broadcast to [B, Hq, Q, L]; sinks broadcast to [B, Hq, Q, 1]. In float32."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is None:
        rows, keys = scores.shape[-2:]
        mask = torch.ones(rows, keys, dtype=torch.bool, device=q.device).tril(keys - rows)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


@dataclass(slots=True)
class DecodeGroup:
    start: int  # rows [start, end) of the flattened batch
    end: int
    num_blocks: int  # blocks gathered per sequence (the group's longest context, rounded up)
    block_table: torch.Tensor  # [n * num_blocks] int64, padded with block 0
    # [n, 1, 1, num_blocks * block_size] additive: 0 on the keys attended (the context, within
    # the window), -inf elsewhere
    mask: torch.Tensor


@dataclass(slots=True)
class PrefillChunk:
    start: int  # rows [start, end) of the flattened batch
    end: int
    context_len: int  # keys gathered: from the first gathered block's to this chunk's last
    # None when the chunk starts at position 0: it attends to its own fresh K/V, causally
    # (mask None) or under a sliding window's mask.
    block_table: torch.Tensor | None  # [num_blocks] int64
    mask: torch.Tensor | None  # [chunk, context_len] bool, True = may attend


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    block_size: int
    # Scratch for gathered K/V, [2, n, block_size, kv_heads, head_dim] per use; reused by every
    # group and layer (they run one after another), so it is allocated once, not per layer.
    workspace: torch.Tensor | None = None
    # What it was built from, and its sliding-window variants by window (built on first use).
    common: CommonAttentionMetadata | None = None
    windowed: dict[int, TorchAttentionMetadata] = field(default_factory=dict)

    def gather_buffer(self, num_blocks: int) -> torch.Tensor:
        assert self.workspace is not None
        _, _, bs, h, d = self.workspace.shape
        return self.workspace.view(-1)[: 2 * num_blocks * bs * h * d].view(2, num_blocks, bs, h, d)


@dataclass(slots=True)
class TorchStaticMetadata:
    """Flat storage the step's tables and masks are carved from, for a maximum batch. The
    torch path's shapes still follow the step (group sizes, context lengths); what stays
    fixed is where its tensors live."""

    max_rows: int
    max_blocks: int
    slot_mapping: torch.Tensor  # int64 [max_rows]
    storage: dict[torch.dtype, torch.Tensor]  # int64 tables, additive masks, bool masks
    workspace: torch.Tensor  # [2, max_rows * max_blocks, block_size, kv_heads, head_dim]


class FreshTensors:
    """build_metadata's tensors: host tensors moved to the device (a no-op on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device

    def put(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device)


@dataclass(slots=True)
class StaticTensors:
    """fill_static_metadata's tensors: copied into the next free part of the storage."""

    storage: dict[torch.dtype, torch.Tensor]
    used: dict[torch.dtype, int] = field(default_factory=dict)

    def put(self, x: torch.Tensor) -> torch.Tensor:
        off, n = self.used.get(x.dtype, 0), x.numel()
        view = self.storage[x.dtype][off : off + n].view(x.shape)
        view.copy_(x)
        self.used[x.dtype] = off + n
        return view


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(
        self,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        decode_group_size: int = 64,
        max_decode_groups: int = 4,
    ):
        super().__init__(block_size, num_heads, num_kv_heads, head_dim, dtype, device)
        self.decode_group_size = decode_group_size
        self.max_decode_groups = max_decode_groups
        self._workspace_blocks = 0
        self._workspace: torch.Tensor | None = None

    @classmethod
    def unsupported_reason(cls, device, dtype, kv_cache_dtype, num_kv_heads, head_dim):
        if kv_cache_dtype == "fp8":  # it reads one, as the triton kernels' reference only
            return "the fp8 KV cache is served by the triton backend"
        return None  # plain torch ops: any device, dtype and cache

    # -- metadata -----------------------------------------------------------------------

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        return self._build(common, FreshTensors(self.device), None)

    def allocate_static_metadata(self, max_rows: int, max_blocks_per_req: int):
        n = max_rows * max_blocks_per_req
        return TorchStaticMetadata(
            max_rows=max_rows,
            max_blocks=max_blocks_per_req,
            slot_mapping=torch.zeros(max_rows, dtype=torch.int64, device=self.device),
            storage={
                torch.int64: torch.zeros(n, dtype=torch.int64, device=self.device),
                self.dtype: torch.zeros(n * self.block_size, dtype=self.dtype, device=self.device),
                torch.bool: torch.zeros(n * self.block_size, dtype=torch.bool, device=self.device),
            },
            workspace=self._workspace_of(n),
        )

    def fill_static_metadata(
        self, static: TorchStaticMetadata, common: CommonAttentionMetadata
    ) -> TorchAttentionMetadata:
        check_static_capacity(common, static.max_rows, static.max_blocks)
        return self._build(common, StaticTensors(static.storage), static)

    def _build(
        self, common, tensors, static: TorchStaticMetadata | None, window: int | None = None
    ) -> TorchAttentionMetadata:
        groups = self._decode_groups(common, tensors, window)
        prefills, need = self._prefill_chunks(common, common.num_decodes, tensors, window)
        for g in groups:
            need = max(need, g.block_table.numel())
        return self._metadata(common, groups, prefills, need, static)

    def for_window(
        self, metadata: TorchAttentionMetadata, window: int | None
    ) -> TorchAttentionMetadata:
        """The step's metadata for a layer of this sliding window (None: the metadata itself).
        Built once a step per window, from the common metadata, on fresh tensors."""
        common = metadata.common
        if window is None or common is None or common.max_seq_len <= window:
            return metadata  # no query sees a key fall out of the window
        windowed = metadata.windowed.get(window)
        if windowed is None:
            windowed = metadata.windowed[window] = self._window_metadata(metadata, window)
        return windowed

    def _window_metadata(
        self, metadata: TorchAttentionMetadata, window: int
    ) -> TorchAttentionMetadata:
        assert metadata.common is not None
        return self._build(metadata.common, FreshTensors(self.device), None, window)

    def _metadata(
        self, common, groups, prefills, need, static, cls=TorchAttentionMetadata, **extra
    ) -> TorchAttentionMetadata:
        """The step's metadata of type cls around its groups and chunks: the slot mapping,
        and the gather workspace for `need` blocks."""
        if static is None:
            slots = common.slot_mapping.to(self.device)
            workspace = self._get_workspace(need) if need else None
        else:
            slots = static.slot_mapping[: common.num_actual_tokens]
            slots.copy_(common.slot_mapping)
            workspace = static.workspace if need else None
        return cls(
            slot_mapping=slots,
            num_decode_tokens=common.num_decode_tokens,
            decode_groups=groups,
            prefills=prefills,
            block_size=self.block_size,
            workspace=workspace,
            common=common,
            **extra,
        )

    def _decode_groups(
        self, common: CommonAttentionMetadata, tensors, window: int | None = None
    ) -> list[DecodeGroup]:
        b = common.num_decodes
        if b == 0:
            return []
        bs = self.block_size
        num_groups = max(1, min(self.max_decode_groups, b // self.decode_group_size))
        # (linspace costs more than the rest of a one-group step's tables)
        bounds = [0, b] if num_groups == 1 else np.linspace(0, b, num_groups + 1).astype(int)
        seq_lens = common.seq_lens_np
        block_table = common.block_table_np
        groups = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            ctx = seq_lens[lo:hi].astype(np.int64)
            if window is None:
                nb = -(-int(ctx.max()) // bs)
                table = block_table[lo:hi, :nb].astype(np.int64)  # block 0 pads: it is reserved
                valid = np.arange(nb * bs)[None, :] < ctx[:, None]
            else:  # each row from the block of its first key in the window
                first = np.maximum(ctx - window, 0) // bs
                ends = -(-ctx // bs)
                nb = int((ends - first).max())
                idx = first[:, None] + np.arange(nb)[None, :]
                held = idx < ends[:, None]
                rows = block_table[lo:hi]
                table = np.where(
                    held, np.take_along_axis(rows, np.minimum(idx, rows.shape[1] - 1), 1), 0
                ).astype(np.int64)
                pos = first[:, None] * bs + np.arange(nb * bs)[None, :]
                valid = (pos < ctx[:, None]) & (pos >= ctx[:, None] - window)
            mask = torch.zeros((hi - lo, 1, 1, nb * bs), dtype=self.dtype)
            mask.masked_fill_(~torch.from_numpy(valid)[:, None, None, :], float("-inf"))
            groups.append(
                DecodeGroup(
                    start=int(lo),
                    end=int(hi),
                    num_blocks=nb,
                    block_table=tensors.put(torch.from_numpy(table.reshape(-1))),
                    mask=tensors.put(mask),
                )
            )
        return groups

    def _prefill_chunks(
        self, common: CommonAttentionMetadata, first_req: int, tensors, window: int | None = None
    ) -> tuple[list[PrefillChunk], int]:
        """The torch path's chunks for requests [first_req, num_reqs), and the blocks the
        largest prefix gather needs; under a sliding window, each masked to it."""
        bs = self.block_size
        qsl = common.query_start_loc_np
        seq_lens = common.seq_lens_np
        block_table = common.block_table_np
        prefills: list[PrefillChunk] = []
        need = 0
        for r in range(first_req, common.num_reqs):
            row, end, ctx = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
            start = ctx - (end - row)
            windowed = window is not None and ctx > window
            if start == 0 and not windowed:
                prefills.append(PrefillChunk(row, end, ctx, None, None))
                continue
            # the blocks from the one holding the first query's first key
            first = max(0, start - window + 1) // bs if windowed else 0
            q_pos = torch.arange(start, ctx)
            k_pos = torch.arange(first * bs, ctx)
            mask = k_pos[None, :] <= q_pos[:, None]
            if windowed:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            if start == 0:  # a fresh prompt longer than the window: its own K/V, masked
                prefills.append(PrefillChunk(row, end, ctx, None, tensors.put(mask)))
                continue
            nb = -(-ctx // bs)
            table = torch.from_numpy(block_table[r, first:nb].astype(np.int64))
            chunk = PrefillChunk(row, end, ctx - first * bs, tensors.put(table), tensors.put(mask))
            prefills.append(chunk)
            need = max(need, nb - first)
        return prefills, need

    def _workspace_of(self, num_blocks: int) -> torch.Tensor:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _get_workspace(self, num_blocks: int) -> torch.Tensor:
        if self._workspace is None or num_blocks > self._workspace_blocks:
            # Grow with headroom so a slowly growing batch does not reallocate every step.
            self._workspace_blocks = max(num_blocks, int(self._workspace_blocks * 1.5))
            self._workspace = self._workspace_of(self._workspace_blocks)
        return self._workspace

    # -- a layer's step -----------------------------------------------------------------

    def write_kv(self, layer: AttentionLayer, k, v, kv_cache, metadata) -> None:
        # the spec's torch ops: the reference's own bytes for every dtype
        spec = layer.kv_spec or KVCacheSpec
        spec.write_reference(kv_cache, _cache_scales(layer), metadata.slot_mapping, k, v)

    def forward(self, layer, q, k, v, kv_cache, metadata: TorchAttentionMetadata) -> torch.Tensor:
        t = q.shape[0]
        metadata = self.for_window(metadata, layer.sliding_window)
        groups = metadata.decode_groups
        if len(groups) == 1 and not metadata.prefills:  # the common all-decode step: no copy
            return self._decode(layer, q, groups[0], kv_cache, metadata).reshape(t, -1)
        out = q.new_empty(t, layer.num_heads, layer.head_dim)
        self._torch_rows(layer, q, k, v, kv_cache, metadata, out)
        return out.view(t, -1)

    def _torch_rows(self, layer, q, k, v, kv_cache, meta: TorchAttentionMetadata, out) -> None:
        """The decode groups' and prefill chunks' rows of out [T, H, D]."""
        for g in meta.decode_groups:
            out[g.start : g.end] = self._decode(layer, q[g.start : g.end], g, kv_cache, meta)
        for p in meta.prefills:
            out[p.start : p.end] = self._prefill(layer, q[p.start : p.end], k, v, p, kv_cache, meta)

    def _decode(self, layer, q, g: DecodeGroup, kv_cache, meta) -> torch.Tensor:
        """One query token per sequence against its gathered, padded context."""
        assert kv_cache is not None
        n, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        kv = self._gather(layer, g.block_table, kv_cache, meta)
        k = kv[0].view(n, -1, hkv, d).transpose(1, 2)  # [n, Hkv, L, D], a view
        v = kv[1].view(n, -1, hkv, d).transpose(1, 2)
        # GQA without repeating K/V: the G query heads sharing a KV head act as G query rows.
        qg = q.view(n, hkv, -1, d)
        if layer.sinks is not None:  # a KV head's G query heads are its G query rows
            sinks = layer.sinks.view(1, hkv, -1, 1)
            o = attend_with_sinks(qg, k, v, g.mask, layer.scale, sinks)
        else:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=layer.scale)
        # reshape, not view: CUDA's SDPA kernels may return [n, Hkv, G, D] in another layout
        return o.reshape(n, layer.num_heads, d)

    def _gather(self, layer, block_table, kv_cache, meta) -> torch.Tensor:
        """K and V of the given blocks, in order: [2, n_blocks, block_size, Hkv, D]."""
        kv = meta.gather_buffer(block_table.numel())
        spec = layer.kv_spec or KVCacheSpec
        return spec.gather_reference(kv_cache, _cache_scales(layer), block_table, kv)

    def _prefill(self, layer, q, k, v, p: PrefillChunk, kv_cache, meta) -> torch.Tensor:
        """A chunk of queries: causal over its own tokens, full over its cached prefix."""
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        sinks = None if layer.sinks is None else layer.sinks.view(1, -1, 1, 1)
        if p.block_table is None:
            kh = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vh = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            if sinks is not None:
                return attend_with_sinks(qh, kh, vh, p.mask, layer.scale, sinks)[0].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qh,
                kh,
                vh,
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=layer.scale,
                enable_gqa=True,
            )
        else:
            assert kv_cache is not None
            kv = self._gather(layer, p.block_table, kv_cache, meta)
            hkv, d = layer.num_kv_heads, layer.head_dim
            kh = kv[0].view(-1, hkv, d)[: p.context_len].transpose(0, 1).unsqueeze(0)
            vh = kv[1].view(-1, hkv, d)[: p.context_len].transpose(0, 1).unsqueeze(0)
            if sinks is not None:
                return attend_with_sinks(qh, kh, vh, p.mask, layer.scale, sinks)[0].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=p.mask, scale=layer.scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)  # [Q, H, D]


def _cache_scales(layer: AttentionLayer):
    """What the cache's spec reads beside its values: an int8 cache's per-row scales, else the
    layer's per-tensor (k_scale, v_scale) (an fp8 cache's; a float cache reads neither)."""
    return layer.kv_scales if layer.kv_scales is not None else (layer.k_scale, layer.v_scale)
