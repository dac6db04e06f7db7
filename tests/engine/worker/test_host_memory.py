"""host_memory.zeros: the CPU KV cache's tensors, in mappings advised for huge pages."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from engine.worker import host_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps(addr: int, field: str) -> list[str]:
    """A field ("VmFlags:", "Rss:") of the mapping of this process that holds addr."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _vm_flags(addr: int) -> list[str]:
    return _smaps(addr, "VmFlags:")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_zeros_is_a_zeroed_writable_tensor_that_outlives_its_mapping_object(dtype):
    t = host_memory.zeros((2, 5, 3, 7), dtype)
    assert t.shape == (2, 5, 3, 7) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    gc.collect()  # only the tensor holds the mapping now
    t[1, 4, 2, 6] = 3
    t[0, 0, 0, 0] = -2
    assert t.sum().item() == 1
    assert host_memory.zeros((0, 4), dtype).shape == (0, 4)


def test_zeros_commits_every_page_at_once():
    """Resident from the start (a cache that faults in during the first busy steps would
    slow them, and an overcommitted host would fail there rather than at start-up)."""
    nbytes = 24 << 20
    t = host_memory.zeros((nbytes // 2 + 3,), torch.bfloat16)  # not a whole number of pages
    rss_kib = int(_smaps(t.data_ptr(), "Rss:")[0])
    assert rss_kib * 1024 >= nbytes
    assert not t.any()


@pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages")
def test_zeros_asks_for_huge_pages():
    t = host_memory.zeros((4, 1 << 20), torch.bfloat16)  # 8 MiB
    assert t.data_ptr() % 4096 == 0
    assert "hg" in _vm_flags(t.data_ptr())  # madvise(MADV_HUGEPAGE) took
    # the same anonymous mapping without the advice has no flag (torch's own allocations are
    # no control: where they land depends on the heap's history in this process)
    plain = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(plain, dtype=torch.uint8)
    raw[::4096] = 1
    assert "hg" not in _vm_flags(raw.data_ptr())
    del raw


@pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages")
def test_the_cpu_kv_cache_is_on_huge_pages(tiny_llama_dir):
    from engine.worker.model_runner import ModelRunner
    from tests.engine.worker.test_model_runner import make_config

    r = ModelRunner(make_config(tiny_llama_dir), model_dir=tiny_llama_dir)
    r.load_model()
    r.init_kv_cache(r.determine_num_blocks())
    for cache in r.kv_caches:
        assert "hg" in _vm_flags(cache.data_ptr())
        assert not cache.any()
