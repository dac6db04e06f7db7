"""The cpu backend: the compiled C paged-attention kernels (engine.attention.cpu_kernel), over
a bf16/float32 cache or the int8 one (engine.attention.kv_int8).

All decodes and the tokens of the leading prefill chunks of modest context (or of a few
tokens: speculative decoding's verification rows) share one padded block table: a prefill
token is a query at its position, its chunk's K/V written first. The other prefill chunks,
past kernel_prefill_max_context(), run on the torch path, exactly as the torch backend runs
them. A layer's sliding window: the kernel takes it as an argument (each row reads from the
block of its first key in the window), the torch path's chunks are masked to it
(TorchAttentionBackend.for_window).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import cpu_kernel, kv_int8
from engine.attention.backends.base import check_static_capacity
from engine.attention.backends.torch import (
    FreshTensors,
    StaticTensors,
    TorchAttentionBackend,
    TorchAttentionMetadata,
    TorchStaticMetadata,
)
from engine.attention.metadata import CommonAttentionMetadata
from engine.kernels.cpu import amx_bf16 as cpu_amx

# Prefill chunks whose context (cached prefix + chunk) is at most this run on the CPU kernel.
KERNEL_PREFILL_MAX_CONTEXT = 2048
# With AMX, torch's SDPA (its CPU flash attention on oneDNN's AMX GEMMs) takes prefill chunks
# beyond this: offline prefill of SmolLM2-135M (64 prompts, 1,024-token steps, machine F),
# SDPA against the kernel: 0.90x the tokens/s at 32-token prompts, level at 64, 1.05x at
# 130, 1.29x at 500. The kernel answers one query row at a time on the vector units.
AMX_KERNEL_PREFILL_MAX_CONTEXT = 64
# Chunks of at most this many query tokens run on the kernel whatever their context: a
# speculative-decoding verification row (the last token and its drafts) is a few decode rows,
# and gathering its whole context for SDPA cost 10x the kernel's time (8 streams of 4-token
# rows on machine F's AMX: 17.5 s of torch rows against 1.7 s of kernel rows in one profile).
KERNEL_SMALL_CHUNK = 16


def kernel_prefill_max_context() -> int:
    """The longest context of a prefill chunk the kernel takes on this CPU."""
    if cpu_amx.available():
        return min(KERNEL_PREFILL_MAX_CONTEXT, AMX_KERNEL_PREFILL_MAX_CONTEXT)
    return KERNEL_PREFILL_MAX_CONTEXT


@dataclass(slots=True)
class KernelDecode:
    """Rows [0, num_rows) of the batch at once on the compiled CPU kernel
    (engine.attention.cpu_kernel): every decode, then the tokens of the leading prefill chunks,
    each as a query at its own position against the cache (its chunk's K/V is written first)."""

    block_tables: torch.Tensor  # [num_rows, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [num_rows] int64
    scratch: torch.Tensor  # float32 [threads, size]: one row per kernel thread
    num_rows: int = 0


@dataclass(slots=True)
class CpuAttentionMetadata(TorchAttentionMetadata):
    # Rows on the kernel (then decode_groups is empty); None when the step has none.
    kernel_decode: KernelDecode | None = None


@dataclass(slots=True)
class CpuStaticMetadata:
    torch_part: TorchStaticMetadata  # slot mapping, and the long prefill chunks' tables
    block_tables: torch.Tensor  # int64 [max_rows, max_blocks]
    context_lens: torch.Tensor  # int64 [max_rows]
    scratch: torch.Tensor  # float32 [threads, size for max_blocks * block_size keys]


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    kv_cache_dtypes = ("auto", "int8")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scratch: torch.Tensor | None = None  # float32 [threads, size], kept across steps

    @classmethod
    def unsupported_reason(cls, device, dtype, kv_cache_dtype, num_kv_heads, head_dim):
        device = torch.device(device)
        if device.type != "cpu":
            return f"the C kernels run on the CPU, and the device is {device}"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"the C kernels take float32 or bfloat16, and the model is {dtype}"
        if cpu_kernel.load_kernel() is None:
            return "the C kernels could not be built (no C compiler, or TESSERA_CPU_KERNELS=0)"
        if not cpu_kernel.kernel_supports(dtype, device, num_kv_heads, head_dim):
            return (
                f"num_kv_heads * head_dim ({num_kv_heads} * {head_dim}) is over the kernel's "
                "row buffer"
            )
        return None

    # -- metadata -----------------------------------------------------------------------

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        return self._build_cpu(common, None)

    def allocate_static_metadata(self, max_rows: int, max_blocks_per_req: int):
        threads = torch.get_num_threads()
        size = self._scratch_size(max_blocks_per_req * self.block_size)
        return CpuStaticMetadata(
            torch_part=super().allocate_static_metadata(max_rows, max_blocks_per_req),
            block_tables=torch.zeros((max_rows, max_blocks_per_req), dtype=torch.int64),
            context_lens=torch.zeros(max_rows, dtype=torch.int64),
            scratch=torch.empty((threads, size), dtype=torch.float32),
        )

    def fill_static_metadata(
        self, static: CpuStaticMetadata, common: CommonAttentionMetadata
    ) -> CpuAttentionMetadata:
        check_static_capacity(common, static.torch_part.max_rows, static.torch_part.max_blocks)
        return self._build_cpu(common, static)

    def _build_cpu(self, common, static: CpuStaticMetadata | None) -> CpuAttentionMetadata:
        # Prefill chunks the kernel takes too: the leading ones of modest context, one kernel
        # row per token. Against SDPA per layer on a fresh prompt (2 Zen 5 cores, bf16): 2.2x
        # at 128 tokens, 2.1x at 512, 1.6x at 1k, 1.3x at 2k; the gap closes beyond.
        seq_lens = common.seq_lens_np
        num_kernel_reqs = common.num_decodes
        limit = kernel_prefill_max_context()
        query_lens = common.query_lens_np
        while num_kernel_reqs < common.num_reqs and (
            seq_lens[num_kernel_reqs] <= limit or query_lens[num_kernel_reqs] <= KERNEL_SMALL_CHUNK
        ):
            num_kernel_reqs += 1
        kernel = self._kernel_rows(common, num_kernel_reqs, static) if num_kernel_reqs else None
        tensors = (
            FreshTensors(self.device)
            if static is None
            else StaticTensors(static.torch_part.storage)
        )
        prefills, need = self._prefill_chunks(common, num_kernel_reqs, tensors)
        torch_static = None if static is None else static.torch_part
        return self._metadata(
            common, [], prefills, need, torch_static, CpuAttentionMetadata, kernel_decode=kernel
        )

    def _scratch_size(self, max_context: int) -> int:
        # The kernels' scratch (see cpu_kernel's C source), the larger of: bf16 cache: q and
        # acc [H, D], a float V tile [bs, Hkv, D], scores [H, L] (AVX512-BF16: acc, scores,
        # their bf16 numerators [H, L + 1] and H sums); int8 cache: acc and int32
        # acc [H, D], int16 q [H, D], scores and int16 weights [H, L + 16], a few per row.
        size = self.num_heads * (3 * self.head_dim + 2 * (max_context + 16) + 2)
        return size + self.block_size * self.num_kv_heads * self.head_dim

    def _kernel_rows(
        self, common: CommonAttentionMetadata, num_reqs: int, static: CpuStaticMetadata | None
    ) -> KernelDecode:
        """One kernel row per query token of requests [0, num_reqs): decodes, then each
        prefill token at its position."""
        bs = self.block_size
        rows = int(common.query_start_loc_np[num_reqs])
        if rows == num_reqs:  # decodes only: a row per request, attending its whole context
            seq_of_row, ctx = None, common.seq_lens_np[:num_reqs]
        else:
            counts = common.query_lens_np[:num_reqs]
            starts = common.start_positions_np[:num_reqs]
            seq_of_row = np.repeat(np.arange(num_reqs), counts)
            offset = np.arange(rows) - np.repeat(common.query_start_loc_np[:num_reqs], counts)
            ctx = starts[seq_of_row] + offset + 1  # keys each row attends: its position + 1
        max_ctx = int(ctx.max())
        nb = -(-max_ctx // bs)
        per_seq = common.block_table_np[:num_reqs, :nb].astype(np.int64)  # block 0 pads
        table = per_seq if seq_of_row is None else per_seq[seq_of_row]
        threads = torch.get_num_threads()
        if static is not None:
            block_tables = static.block_tables[:rows]
            block_tables[:, :nb].copy_(torch.from_numpy(table))
            block_tables[:, nb:].zero_()
            context_lens = static.context_lens[:rows]
            context_lens.copy_(torch.from_numpy(ctx))
            return KernelDecode(
                block_tables,
                context_lens,
                static.scratch[: min(threads, len(static.scratch))],
                rows,
            )
        size = self._scratch_size(max_ctx)
        if (
            self._scratch is None
            or self._scratch.shape[0] < threads
            or self._scratch.shape[1] < size
        ):
            # Kept across steps; grown with headroom as contexts get longer.
            old = 0 if self._scratch is None else self._scratch.shape[1]
            self._scratch = torch.empty((threads, max(size, int(old * 1.5))), dtype=torch.float32)
        return KernelDecode(
            block_tables=torch.from_numpy(np.ascontiguousarray(table)),
            context_lens=torch.from_numpy(ctx),
            scratch=self._scratch[:threads],
            num_rows=rows,
        )

    def _window_metadata(self, metadata, window: int) -> CpuAttentionMetadata:
        """The same kernel rows (the kernel applies the window itself), the torch path's
        prefill chunks masked to the window."""
        common = metadata.common
        first_req = common.num_reqs - len(metadata.prefills)
        prefills, need = self._prefill_chunks(common, first_req, FreshTensors(self.device), window)
        workspace = self._get_workspace(need) if need else None
        return dataclasses.replace(metadata, prefills=prefills, workspace=workspace, windowed={})

    # -- a layer's step -----------------------------------------------------------------

    def write_kv(self, layer, k, v, kv_cache, metadata) -> None:
        if layer.kv_scales is not None:  # the C writer where it runs (the same bytes)
            kv_int8.write(kv_cache, layer.kv_scales, metadata.slot_mapping, k, v)
            return
        d = layer.head_dim
        if kv_cache.dtype == k.dtype and all(x.stride(2) == 1 and x.stride(1) == d for x in (k, v)):
            cpu_kernel.write_kv(kv_cache[0], kv_cache[1], metadata.slot_mapping, k, v)
            return  # index_copy_'s bytes, as row copies
        super().write_kv(layer, k, v, kv_cache, metadata)

    def forward(self, layer, q, k, v, kv_cache, metadata: CpuAttentionMetadata) -> torch.Tensor:
        t = q.shape[0]
        out = q.new_empty(t, layer.num_heads, layer.head_dim)
        metadata = self.for_window(metadata, layer.sliding_window)
        kd = metadata.kernel_decode
        if kd is not None:
            assert kv_cache is not None
            n, scales = kd.num_rows, layer.kv_scales
            ks, vs = (None, None) if scales is None else (scales[0], scales[1])
            cpu_kernel.paged_decode(
                out[:n], q[:n], kv_cache[0], kv_cache[1], kd.block_tables, kd.context_lens,
                kd.scratch, layer.scale, ks, vs, layer.sliding_window, layer.sinks,
            )  # fmt: skip
        self._torch_rows(layer, q, k, v, kv_cache, metadata, out)
        return out.view(t, -1)
