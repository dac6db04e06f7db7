"""The attention backend interface: what the layer, the model runner and a graph runner call.

A backend is chosen once at start (engine.attention.backends.select_backend) and shared by
every layer. It owns the KV cache's layout: kv_cache_spec gives the model runner the bytes a
block takes and the allocation for `--kv-cache-dtype` (engine.attention.kv_spec). Per step the runner turns its batch into CommonAttentionMetadata
(engine.attention.metadata), the backend builds its own metadata from it once, and each
layer then calls write_kv and forward with that metadata. A graph runner instead allocates
static metadata for its largest batch once and fills it in place every step, so the
addresses a captured step reads stay put.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from engine.attention.kv_spec import KVCacheSpec, kv_cache_spec
from engine.attention.metadata import CommonAttentionMetadata


class AttentionLayer(Protocol):
    """What a backend reads from the layer it runs for (engine.attention.layer.PagedAttention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    kv_scales: torch.Tensor | None  # float32 [2, blocks, kv_heads, block_size], int8 cache only
    kv_spec: KVCacheSpec | None  # the cache's spec (None: the model's dtype), bound with it
    # an fp8 cache's per-tensor scales (stores x / scale): the checkpoint's, else 1.0
    k_scale: float
    v_scale: float
    # Query position i attends key j iff i - sliding_window < j <= i; None: all j <= i. The
    # step's metadata is the same for every layer: a backend applies the window in forward.
    sliding_window: int | None
    # float32 [H]: a logit per query head that joins every softmax with no value (gpt-oss's
    # attention sinks); None: none
    sinks: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """A backend's metadata for one step; each backend extends it with what it needs."""

    slot_mapping: torch.Tensor  # [T] int64 on the backend's device


class AttentionBackend(ABC):
    """One way to run paged attention over the flattened batch.

    The KV cache of a layer is one tensor [2, num_blocks, block_size, kv_heads, head_dim]
    (k = cache[0], v = cache[1]), as kv_cache_spec lays it out; token t's K/V live at flat
    slot slot_mapping[t]. An int8 cache comes with its scales on the layer
    (engine.attention.kv_int8).
    """

    name: ClassVar[str]
    # Whether a CUDA graph captured over fill_static_metadata's result replays correctly for
    # any later fill with the same number of rows: the tensors' addresses and shapes, and
    # forward's launches (grids, split counts), depend only on that number, never on the
    # step's contents (context lengths). The torch reference's shapes follow the contexts.
    cuda_graph_capturable: ClassVar[bool] = False
    # The --kv-cache-dtype values this backend's kernels read (select_backend checks it before
    # unsupported_reason); None: every registered one, through each KV cache spec's torch ops
    # (write_reference / gather_reference), as the torch reference does.
    kv_cache_dtypes: ClassVar[tuple[str, ...] | None] = None

    def __init__(
        self,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)

    @classmethod
    @abstractmethod
    def unsupported_reason(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        num_kv_heads: int,
        head_dim: int,
    ) -> str | None:
        """None where this backend can run such a model, else why not (for the user)."""

    @classmethod
    def kv_cache_dtype_reason(cls, kv_cache_dtype: str) -> str | None:
        """None where this backend reads a kv_cache_dtype cache, else why not."""
        if cls.kv_cache_dtypes is None or kv_cache_dtype in cls.kv_cache_dtypes:
            return None
        return (
            f"its kernels do not read a KV cache of dtype {kv_cache_dtype} (they read "
            f"{', '.join(cls.kv_cache_dtypes)})"
        )

    def kv_cache_spec(self, kv_cache_dtype: str) -> KVCacheSpec:
        """The KV cache's layout for kv_cache_dtype (auto: the model's dtype): bytes a block and
        allocation. The registered spec (engine.attention.kv_spec.KV_CACHE_SPECS) over this
        backend's block size, KV heads, head size and dtype; a backend that lays its cache out
        otherwise returns a spec of its own."""
        return kv_cache_spec(
            kv_cache_dtype, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """This step's metadata, built once and shared by every layer."""

    @abstractmethod
    def write_kv(
        self,
        layer: AttentionLayer,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Store this step's k/v [T, Hkv, D] (may be strided views) at their slots."""

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (this step's, already written) -> [T, H * D]."""

    # -- the hooks of a graph runner ----------------------------------------------------

    @abstractmethod
    def allocate_static_metadata(self, max_rows: int, max_blocks_per_req: int) -> object:
        """Buffers for any step of up to max_rows query tokens whose requests each hold up to
        max_blocks_per_req blocks; allocated once."""

    @abstractmethod
    def fill_static_metadata(
        self, static: object, common: CommonAttentionMetadata
    ) -> AttentionMetadata:
        """This step's metadata written into `static` (from allocate_static_metadata) in
        place: the result's tensors are views of those buffers, and forward gives with it
        what it gives with build_metadata(common)."""


def check_static_capacity(common: CommonAttentionMetadata, max_rows: int, max_blocks: int) -> None:
    if common.num_actual_tokens > max_rows or common.block_table.shape[1] > max_blocks:
        raise ValueError(
            f"a step of {common.num_actual_tokens} tokens and {common.block_table.shape[1]} "
            f"blocks per request does not fit static buffers of {max_rows} rows and "
            f"{max_blocks} blocks"
        )
