"""The KV cache spec (engine.attention.kv_spec): for each --kv-cache-dtype the bytes a block
takes are what its allocation holds, scales included; the backend returns it, the registry
is the option's choices, and the layers see the dtype the spec names."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.attention import kv_fp8
from engine.attention.backends import backend_class
from engine.attention.kv_spec import (
    KV_CACHE_DTYPE_CHOICES,
    KV_CACHE_SPECS,
    KVCacheSpec,
    kv_cache_spec,
    spec_class,
)
from engine.config import CacheConfig

BLOCK, KV_HEADS, HEAD = 16, 3, 64
CPU = torch.device("cpu")

# (kv_cache_dtype, model dtype) -> (storage dtype, layers' dtype, bytes of scales a token)
CASES = {
    ("auto", torch.bfloat16): (torch.bfloat16, torch.bfloat16, 0),
    ("auto", torch.float32): (torch.float32, torch.float32, 0),
    ("int8", torch.bfloat16): (torch.int8, torch.int8, 2 * 4 * KV_HEADS),
    ("fp8", torch.bfloat16): (torch.uint8, kv_fp8.FP8_DTYPE, 0),
}


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(("kv_dtype", "dtype"), list(CASES), ids=lambda x: str(x))
def test_bytes_per_block_are_what_the_allocation_holds(kv_dtype, dtype) -> None:
    storage_dtype, layer_dtype, scale_bytes = CASES[kv_dtype, dtype]
    spec = kv_cache_spec(kv_dtype, BLOCK, KV_HEADS, HEAD, dtype)
    blocks, layers = 5, 3
    kv = spec.allocate(blocks, CPU, num_layers=layers)
    assert len(kv.storage) == len(kv.views) == layers
    assert len(kv.scales) == (layers if scale_bytes else 0)
    assert _bytes(kv.storage) + _bytes(kv.scales) == blocks * layers * spec.bytes_per_block
    values = 2 * BLOCK * KV_HEADS * HEAD * storage_dtype.itemsize
    assert spec.bytes_per_block == values + BLOCK * scale_bytes
    for i in range(layers):
        cache, scales = kv.layer(i)
        assert cache.shape == (2, blocks, BLOCK, KV_HEADS, HEAD) and not cache.any()
        assert kv.storage[i].dtype == storage_dtype and cache.dtype == layer_dtype
        assert cache.data_ptr() == kv.storage[i].data_ptr()  # a view: block copies reach it
        assert (scales is None) == (scale_bytes == 0)
    assert spec.cache_dtype == layer_dtype and spec.storage_dtype == storage_dtype


def test_int8_scales_are_the_layers_layout() -> None:
    cache, scales = (
        kv_cache_spec("int8", BLOCK, KV_HEADS, HEAD, torch.bfloat16).allocate(4, CPU).layer(0)
    )
    assert scales is not None and scales.dtype == torch.float32
    assert scales.shape == (2, 4, KV_HEADS, BLOCK)  # the kernels' [2, blocks, kv_heads, bs]


def test_allocation_goes_through_the_runners_allocator() -> None:
    made = []

    def zeros(shape, dtype):
        made.append((shape, dtype))
        return torch.zeros(shape, dtype=dtype)

    spec = kv_cache_spec("fp8", BLOCK, KV_HEADS, HEAD, torch.bfloat16)
    spec.allocate(2, CPU, num_layers=2, zeros=zeros)
    assert made == [((2, 2, BLOCK, KV_HEADS, HEAD), torch.uint8)] * 2


def test_the_backend_returns_the_registered_spec() -> None:
    backend = backend_class("torch")(BLOCK, 6, KV_HEADS, HEAD, torch.bfloat16)
    for name in KV_CACHE_DTYPE_CHOICES:
        spec = backend.kv_cache_spec(name)
        assert type(spec) is spec_class(name) and isinstance(spec, KVCacheSpec)
        assert (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype) == (
            BLOCK,
            KV_HEADS,
            HEAD,
            torch.bfloat16,
        )
    assert type(backend.kv_cache_spec("auto")) is KVCacheSpec
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        backend.kv_cache_spec("int4")


def test_the_registry_is_the_options_choices() -> None:
    assert KV_CACHE_DTYPE_CHOICES == tuple(KV_CACHE_SPECS) == ("auto", "int8", "fp8")
    for name in KV_CACHE_DTYPE_CHOICES:
        assert CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, int8 or fp8"):
        CacheConfig(kv_cache_dtype="int4")


def test_the_runners_cache_is_the_specs(tiny_llama_dir) -> None:
    """The model runner sizes and allocates through the spec: a block's bytes over all
    layers, and the tensors it binds to the layers."""
    from engine import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=40, kv_cache_dtype="int8")
    runner = llm.engine.executor.runner
    spec = runner.kv_cache_spec()
    layers = runner.hf_config.num_hidden_layers
    assert runner.kv_block_bytes() == layers * spec.bytes_per_block
    assert _bytes(runner.kv_caches) + _bytes(runner.kv_scales) == 40 * runner.kv_block_bytes()
    for attn, cache, scales in zip(
        runner.model.attention_layers(), runner.kv_caches, runner.kv_scales, strict=True
    ):
        assert attn.kv_cache is cache and attn.kv_scales is scales
    llm.shutdown()


@dataclass(slots=True, frozen=True)
class DoubledKVCacheSpec(KVCacheSpec):
    """A KV dtype as a new one would be added: one class with its torch ops (here K and V
    stored times two, exact in binary floating point) and nothing in any backend."""

    @staticmethod
    def write_reference(cache, scales, slot_mapping, k, v) -> None:
        KVCacheSpec.write_reference(cache, scales, slot_mapping, k * 2, v * 2)

    @staticmethod
    def gather_reference(cache, scales, block_table, out):
        return KVCacheSpec.gather_reference(cache, scales, block_table, out).mul_(0.5)


def test_a_new_kv_dtype_needs_no_backend_change():
    """The torch backend serves a spec through its ops alone, with the same output as the
    model-dtype cache; the kernel backends refuse a dtype they do not list."""
    from engine.attention.backends import select_backend
    from engine.attention.backends.torch import TorchAttentionBackend
    from engine.attention.layer import PagedAttention
    from engine.attention.metadata import common_metadata_from_seqs

    heads, g = 2 * KV_HEADS, torch.Generator().manual_seed(0)
    seqs = [(5, 1, [1]), (17, 1, [2, 3]), (0, 9, [4])]  # two decodes, a prefill
    t = sum(n for _, n, _ in seqs)
    q, k, v = (torch.randn(t, h, HEAD, generator=g) for h in (heads, KV_HEADS, KV_HEADS))
    outs, caches = [], []
    for spec in (None, DoubledKVCacheSpec(BLOCK, KV_HEADS, HEAD, torch.float32)):
        backend = TorchAttentionBackend(BLOCK, heads, KV_HEADS, HEAD, torch.float32)
        attn = PagedAttention(heads, KV_HEADS, HEAD, HEAD**-0.5)
        attn.kv_cache = torch.randn(2, 5, BLOCK, KV_HEADS, HEAD, generator=g)
        attn.kv_spec, attn.backend = spec, backend
        if spec is not None:
            attn.kv_cache = caches[0] * 2  # the same context, as this dtype stores it
        caches.append(attn.kv_cache.clone())
        with torch.inference_mode():
            outs.append(attn(q, k, v, backend.build_metadata(common_metadata_from_seqs(seqs, 16))))
    assert torch.equal(outs[0], outs[1])
    assert select_backend("torch", CPU, torch.float32, "doubled", KV_HEADS, HEAD)
    with pytest.raises(ValueError, match="do not read a KV cache of dtype doubled"):
        select_backend("cpu", CPU, torch.float32, "doubled", KV_HEADS, HEAD)
