"""Paged attention over a flattened batch: the torch path, reference for every faster kernel.

Per layer the KV cache is one tensor [2, num_blocks, block_size, kv_heads, head_dim]
(k = cache[0], v = cache[1]); token t's K/V live at flat slot slot_mapping[t]. An int8 cache
comes with its scales (engine.attention.kv_int8). Decodes run as
a few padded groups through SDPA, or all at once through the compiled CPU kernel when the
metadata says so (engine.attention.cpu_kernel); prefill chunks run one SDPA call each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import cpu_kernel, kv_int8
from engine.attention.metadata import AttentionMetadata, DecodeGroup, PrefillChunk


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.kv_scales: torch.Tensor | None = None  # float32, with an int8 cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (may be strided views) -> [T, H * D]."""
        cache, scales = self.kv_cache, self.kv_scales
        if scales is not None:
            kv_int8.write(cache, scales, meta.slot_mapping, k, v)
        elif cache is not None:
            flat = cache.view(2, -1, self.num_kv_heads, self.head_dim)
            flat[0].index_copy_(0, meta.slot_mapping, k)
            flat[1].index_copy_(0, meta.slot_mapping, v)
        t = q.shape[0]
        groups, prefills = meta.decode_groups, meta.prefills
        if len(groups) == 1 and not prefills:  # the common all-decode step: no output copy
            return self._decode(q, groups[0], meta).reshape(t, -1)
        out = q.new_empty(t, self.num_heads, self.head_dim)
        kd = meta.kernel_decode
        if kd is not None:
            assert cache is not None
            n = kd.num_rows
            ks, vs = (None, None) if scales is None else (scales[0], scales[1])
            cpu_kernel.paged_decode(
                out[:n], q[:n], cache[0], cache[1], kd.block_tables, kd.context_lens,
                kd.scratch, self.scale, ks, vs,
            )  # fmt: skip
        for g in groups:
            out[g.start : g.end] = self._decode(q[g.start : g.end], g, meta)
        for p in prefills:
            out[p.start : p.end] = self._prefill(q[p.start : p.end], k, v, p, meta)
        return out.view(t, -1)

    def _decode(self, q: torch.Tensor, g: DecodeGroup, meta: AttentionMetadata) -> torch.Tensor:
        """One query token per sequence against its gathered, padded context."""
        assert self.kv_cache is not None
        n, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        kv = self._gather(g.block_table, meta)
        k = kv[0].view(n, -1, hkv, d).transpose(1, 2)  # [n, Hkv, L, D], a view
        v = kv[1].view(n, -1, hkv, d).transpose(1, 2)
        # GQA without repeating K/V: the G query heads sharing a KV head act as G query rows.
        qg = q.view(n, hkv, -1, d)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale)
        return o.view(n, self.num_heads, d)

    def _gather(self, block_table: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """K and V of the given blocks, in order: [2, n_blocks, block_size, Hkv, D]."""
        kv = meta.gather_buffer(block_table.numel())
        if self.kv_scales is not None:
            return kv_int8.gather_dequantized(self.kv_cache, self.kv_scales, block_table, kv)
        # Two dim-0 selects copy whole blocks; one select over dim 1 goes element-wise.
        torch.index_select(self.kv_cache[0], 0, block_table, out=kv[0])
        torch.index_select(self.kv_cache[1], 0, block_table, out=kv[1])
        return kv

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: PrefillChunk,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """A chunk of queries: causal over its own tokens, full over its cached prefix."""
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if p.block_table is None:
            kh = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            vh = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            assert self.kv_cache is not None
            kv = self._gather(p.block_table, meta)
            hkv, d = self.num_kv_heads, self.head_dim
            kh = kv[0].view(-1, hkv, d)[: p.context_len].transpose(0, 1).unsqueeze(0)
            vh = kv[1].view(-1, hkv, d)[: p.context_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=p.mask, scale=self.scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)  # [Q, H, D]
