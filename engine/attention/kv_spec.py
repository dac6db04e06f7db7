"""The KV cache's layout: what a block of one layer holds, its bytes, and its allocation.

The attention backend returns the spec (AttentionBackend.kv_cache_spec) for
`--kv-cache-dtype`; the model runner sizes the cache by its bytes a block and binds what its
allocate returns to the layers, and never names a KV dtype itself. KVCacheSpec is `auto`
(the model's dtype); each other dtype is a subclass in the file that holds its quantizer and
reference ops (kv_int8.py, kv_fp8.py), which the spec's write_reference / gather_reference
name. A new KV dtype is such a file plus one line in KV_CACHE_SPECS, whose keys are
`--kv-cache-dtype`'s choices: the torch backend serves it through those two ops at once; a
kernel backend serves the dtypes it lists (AttentionBackend.kv_cache_dtypes).

This module imports no torch and no spec's file until one is chosen, so the config can
validate names cheaply (as engine.attention.backends does for backends).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# --kv-cache-dtype -> "module:class", imported when chosen
KV_CACHE_SPECS = {
    "auto": "engine.attention.kv_spec:KVCacheSpec",
    "int8": "engine.attention.kv_int8:Int8KVCacheSpec",
    "fp8": "engine.attention.kv_fp8:Fp8KVCacheSpec",
}
KV_CACHE_DTYPE_CHOICES = tuple(KV_CACHE_SPECS)

# (shape, dtype) -> a zeroed tensor: how the runner allocates a cache (on the CPU in huge pages)
Zeros = Callable[[tuple[int, ...], "torch.dtype"], "torch.Tensor"]


def spec_class(kv_cache_dtype: str) -> type[KVCacheSpec]:
    if kv_cache_dtype not in KV_CACHE_SPECS:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of "
            f"{', '.join(KV_CACHE_DTYPE_CHOICES)}"
        )
    module, cls = KV_CACHE_SPECS[kv_cache_dtype].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(slots=True)
class KVCacheTensors:
    """A whole cache, one entry per layer. storage: as allocated, [2, blocks, block_size,
    kv_heads, head_size] each (block copies index these)."""

    storage: list[torch.Tensor]
    views: list[torch.Tensor]  # what the layers and backends read: storage, or a view of it
    scales: list[torch.Tensor]  # where the spec keeps scales beside the values, else empty

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i's (kv_cache, kv_scales), as PagedAttention holds them."""
        return self.views[i], self.scales[i] if self.scales else None


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """`auto`: K and V in the model's dtype, one tensor a layer [2, blocks, block_size,
    kv_heads, head_size] (k = cache[0], v = cache[1]), no scales."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype  # the model's (activations')

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the layers and backends see."""
        return self.dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype allocated (block copies index it): the cache dtype unless a dtype's index
        kernels are missing on some device (fp8: bytes)."""
        return self.cache_dtype

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of scales beside one token's K (and as many beside its V), one layer."""
        return 0

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V in one layer, scales included."""
        values = self.num_kv_heads * self.head_size * self.storage_dtype.itemsize
        return 2 * (values + self.scale_bytes_per_token)

    @property
    def bytes_per_block(self) -> int:
        """One block of one layer, K and V, scales included."""
        return self.block_size * self.bytes_per_token

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def view(self, storage: torch.Tensor) -> torch.Tensor:
        """The layers' view of an allocated cache tensor."""
        return storage

    # -- the torch reference's ops: the torch backend serves any registered dtype through
    # these (a faster backend has kernels of its own and lists the dtypes it takes). scales:
    # what the dtype keeps beside its values (int8: the per-row tensor; fp8: the layer's
    # (k_scale, v_scale)); the model dtype's cache reads none --

    @staticmethod
    def write_reference(
        cache: torch.Tensor,
        scales,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store k/v [T, Hkv, D] at their flat slots of one layer's cache (the layers' view)."""
        _, hkv, d = k.shape
        flat = cache.view(2, -1, hkv, d)
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)

    @staticmethod
    def gather_reference(
        cache: torch.Tensor,
        scales,
        block_table: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """The given blocks, in order, in out's dtype: out [2, n, block_size, Hkv, D]."""
        import torch

        # Two dim-0 selects copy whole blocks; one select over dim 1 goes element-wise.
        torch.index_select(cache[0], 0, block_table, out=out[0])
        torch.index_select(cache[1], 0, block_table, out=out[1])
        return out

    def allocate_scales(self, num_blocks: int, device: torch.device) -> torch.Tensor | None:
        """One layer's scales, or None where the dtype keeps none beside the values."""
        return None

    def allocate(
        self,
        num_blocks: int,
        device: torch.device,
        num_layers: int = 1,
        zeros: Zeros | None = None,
    ) -> KVCacheTensors:
        """num_layers caches of num_blocks blocks, zeroed (the caches by `zeros`, default
        torch.zeros on device), then their scales."""
        if zeros is None:
            import torch

            def zeros(shape, dtype):
                return torch.zeros(shape, dtype=dtype, device=device)

        shape, dtype = self.shape(num_blocks), self.storage_dtype
        storage = [zeros(shape, dtype) for _ in range(num_layers)]
        scales = [self.allocate_scales(num_blocks, device) for _ in range(num_layers)]
        return KVCacheTensors(
            storage,
            [self.view(t) for t in storage],
            [s for s in scales if s is not None],
        )


def kv_cache_spec(
    kv_cache_dtype: str, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> KVCacheSpec:
    """The spec registered for kv_cache_dtype (auto: the model's dtype)."""
    return spec_class(kv_cache_dtype)(block_size, num_kv_heads, head_size, dtype)
