"""The triton backend: the Triton kernels of engine.kernels.triton on CUDA (`auto` there).

Per step the metadata is the common one on the device (query offsets, sequence lengths, the
int32 block table, the slot mapping) plus the kernel's tiles (engine.kernels.triton.
paged_attention.plan_launch); every layer then stores its K/V through the slot mapping and
runs one paged-attention launch (two where a small decode batch splits its contexts) that
reads the cache in place. Caches: the model's dtype, or fp8 e4m3 (engine.attention.kv_fp8).

A graph runner's hooks: allocate_static_metadata sizes device buffers for its largest batch
once (the split launch's partial results included); fill_static_metadata copies a step's
tables into them in place (copy_(..., non_blocking=True)). A launch's shape follows only the
batch's size and query lengths, never its contexts, so a graph captured for a batch size
replays for any context (a layer's sliding window is a launch argument, the same every
step). Padding requests of a padded batch: one query token each, slot
PAD_SLOT_ID (written nowhere) and seq_len 0 (no keys read, zeros out).

Triton is imported when a backend is built, never when this module is: a CPU install can
import the engine (and name this backend) without it. Under TRITON_INTERPRET=1 the backend
also runs on CPU tensors: that is how the tests check it without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.backends.base import (
    AttentionBackend,
    AttentionMetadata,
    check_static_capacity,
)
from engine.attention.backends.torch import attend_with_sinks
from engine.attention.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from engine.kernels.triton import AttentionLaunch

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on the device
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, blocks] (a static one: a view, wider rows)
    tile_req: torch.Tensor  # int32 [num_tiles]
    tile_qstart: torch.Tensor  # int32 [num_tiles]
    launch: AttentionLaunch  # the tiles and the launch's shape (python ints)
    # Flat fp32 buffers (out, max, sum) of a split launch; None otherwise.
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # The offsets and lengths on the host: the cacheless path (a profile run) reads them.
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray


@dataclass(slots=True)
class TritonStaticMetadata:
    """Fixed device buffers for any step of up to max_rows tokens and max_blocks blocks per
    request; a step's metadata is views of their leading parts."""

    max_rows: int
    max_blocks: int
    slot_mapping: torch.Tensor  # int64 [max_rows]
    query_start_loc: torch.Tensor  # int32 [max_rows + 1]
    seq_lens: torch.Tensor  # int32 [max_rows]
    block_table: torch.Tensor  # int32 [max_rows, max_blocks]
    tile_req: torch.Tensor  # int32 [2 * max_rows]: a step has at most num_reqs + T tiles
    tile_qstart: torch.Tensor
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # for the largest split step


def triton_import_error() -> str | None:
    """Why triton cannot be imported here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'tessera[gpu]')"
    except Exception as exc:  # a broken install: say what it raised
        return f"triton does not import: {exc}"
    return None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # Its launch grid follows the batch's row count and query lengths only, never the
    # contexts, so a graph captured for a batch size replays for any context.
    cuda_graph_capturable = True
    kv_cache_dtypes = ("auto", "fp8")  # int8 is the CPU kernels' tiled layout

    def __init__(
        self,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        split_target_programs: int | None = None,
    ):
        super().__init__(block_size, num_heads, num_kv_heads, head_dim, dtype, device)
        from engine.kernels import triton as kernels  # imports triton: only once chosen

        self._kernels = kernels
        self.queries_per_kv = num_heads // num_kv_heads
        # Decode steps with fewer (requests x KV heads) programs than this split their
        # contexts: two waves of programs per SM on a GPU; none under the interpreter.
        if split_target_programs is None:
            split_target_programs = (
                2 * torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else 1
            )
        self.split_target_programs = split_target_programs

    @classmethod
    def unsupported_reason(cls, device, dtype, kv_cache_dtype, num_kv_heads, head_dim):
        device = torch.device(device)
        if device.type != "cuda":
            return f"the Triton kernels run on CUDA devices, and the device is {device}"
        if dtype not in SUPPORTED_DTYPES:
            return f"the Triton kernels take bfloat16, float16 or float32, and the model is {dtype}"
        if head_dim > MAX_HEAD_DIM:
            return f"head_dim {head_dim} is over the kernel's {MAX_HEAD_DIM}"
        return triton_import_error()

    # -- metadata -----------------------------------------------------------------------

    def _plan(self, common: CommonAttentionMetadata):
        return self._kernels.plan_launch(
            common.query_lens_np, self.queries_per_kv, self.num_kv_heads, self.split_target_programs
        )

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        launch = self._plan(common)
        dev = self.device
        return TritonAttentionMetadata(
            slot_mapping=common.slot_mapping.to(dev, non_blocking=True),
            query_start_loc=common.query_start_loc.to(dev, non_blocking=True),
            seq_lens=common.seq_lens.to(dev, non_blocking=True),
            block_table=common.block_table.to(dev, non_blocking=True),
            tile_req=torch.from_numpy(launch.tile_req).to(dev, non_blocking=True),
            tile_qstart=torch.from_numpy(launch.tile_qstart).to(dev, non_blocking=True),
            launch=launch,
            partials=self._partials(common.num_actual_tokens * launch.num_splits)
            if launch.num_splits > 1
            else None,
            query_start_loc_np=common.query_start_loc_np,
            seq_lens_np=common.seq_lens_np,
        )

    def allocate_static_metadata(self, max_rows: int, max_blocks_per_req: int):
        dev = self.device

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(shape, dtype=dtype, device=dev)

        split_rows = self._kernels.max_split_rows(
            max_rows, self.num_kv_heads, self.split_target_programs
        )
        return TritonStaticMetadata(
            max_rows=max_rows,
            max_blocks=max_blocks_per_req,
            slot_mapping=zeros(max_rows, dtype=torch.int64),
            query_start_loc=zeros(max_rows + 1),
            seq_lens=zeros(max_rows),
            block_table=zeros(max_rows, max_blocks_per_req),
            tile_req=zeros(2 * max_rows),
            tile_qstart=zeros(2 * max_rows),
            partials=self._partials(split_rows),
        )

    def _partials(self, rows_x_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A split launch's fp32 partial results (out, running max, sum), one set shared by
        every layer of a step (they run one after another)."""
        n = rows_x_splits * self.num_heads
        f32 = {"dtype": torch.float32, "device": self.device}
        return torch.empty(n * self.head_dim, **f32), torch.empty(n, **f32), torch.empty(n, **f32)

    def fill_static_metadata(
        self, static: TritonStaticMetadata, common: CommonAttentionMetadata
    ) -> TritonAttentionMetadata:
        check_static_capacity(common, static.max_rows, static.max_blocks)
        launch = self._plan(common)
        n, t = common.num_reqs, common.num_actual_tokens
        width, tiles = common.block_table.shape[1], launch.num_tiles

        def put(buf: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            buf.copy_(src, non_blocking=True)
            return buf

        return TritonAttentionMetadata(
            slot_mapping=put(static.slot_mapping[:t], common.slot_mapping),
            query_start_loc=put(static.query_start_loc[: n + 1], common.query_start_loc),
            seq_lens=put(static.seq_lens[:n], common.seq_lens),
            # Only the first `width` columns are read: no request has more blocks.
            block_table=put(static.block_table[:n, :width], common.block_table),
            tile_req=put(static.tile_req[:tiles], torch.from_numpy(launch.tile_req)),
            tile_qstart=put(static.tile_qstart[:tiles], torch.from_numpy(launch.tile_qstart)),
            launch=launch,
            partials=static.partials if launch.num_splits > 1 else None,
            query_start_loc_np=common.query_start_loc_np,
            seq_lens_np=common.seq_lens_np,
        )

    # -- a layer's step -----------------------------------------------------------------

    def write_kv(self, layer, k, v, kv_cache, metadata: TritonAttentionMetadata) -> None:
        self._kernels.store_kv(k, v, kv_cache, metadata.slot_mapping, layer.k_scale, layer.v_scale)

    def forward(self, layer, q, k, v, kv_cache, metadata: TritonAttentionMetadata):
        t = q.shape[0]
        if kv_cache is None:
            return self._without_cache(layer, q, k, v, metadata).view(t, -1)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = q.new_empty(t, layer.num_heads, layer.head_dim)
        self._kernels.paged_attention(
            out, q, kv_cache,
            metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
            metadata.tile_req, metadata.tile_qstart, metadata.launch,
            layer.scale, layer.k_scale, layer.v_scale, metadata.partials,
            layer.sliding_window, layer.sinks,
        )  # fmt: skip
        return out.view(t, -1)

    def _without_cache(self, layer, q, k, v, meta: TritonAttentionMetadata) -> torch.Tensor:
        """No cache bound yet (the runner's profile run, before the KV cache is sized): every
        request is a prompt from position 0, attending causally to its own K/V."""
        out = q.new_empty(q.shape[0], layer.num_heads, layer.head_dim)
        qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
        for r in range(len(seq_lens)):
            lo, hi = int(qsl[r]), int(qsl[r + 1])
            if seq_lens[r] != hi - lo:
                raise RuntimeError("a step over cached tokens needs the KV cache bound")
            qh, kh, vh = (x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            mask, window = None, layer.sliding_window
            if window is not None and hi - lo > window:
                pos = torch.arange(hi - lo, device=q.device)
                diff = pos[:, None] - pos[None, :]
                mask = (diff >= 0) & (diff < window)
            if layer.sinks is not None:
                sinks = layer.sinks.view(1, -1, 1, 1)
                o = attend_with_sinks(qh, kh, vh, mask, layer.scale, sinks)
            else:
                o = F.scaled_dot_product_attention(
                    qh,
                    kh,
                    vh,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=layer.scale,
                    enable_gqa=True,
                )
            out[lo:hi] = o[0].transpose(0, 1)
        return out
