"""Large host tensors on transparent huge pages: the CPU KV cache.

A decode step reads every running sequence's K/V blocks, scattered over a cache of gigabytes.
On 4 KiB pages each 6 KiB block costs its own TLB misses and page walks; on 2 MiB pages the
walks mostly vanish. Linux gives anonymous memory huge pages only where a mapping asks for
them (/sys/kernel/mm/transparent_hugepage/enabled is often `madvise`), and torch's allocator
does not ask. Measured on two Xeon (AMX) cores, the bf16 paged-attention kernel over a 2.4 GB
cache, 128 rows of 64-320 tokens: 0.68-0.70 ms a layer on huge pages against 0.76-0.78 on
4 KiB pages (BENCHMARKS.md).

Where huge pages are off or unavailable, madvise is refused or ignored and the memory is
ordinary pages: the same tensor, no error.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own anonymous mapping, advised to use huge pages, and
    touched now (committed at start-up, as torch.zeros would, not on the first step that
    reaches a page). The mapping is freed with the last tensor that views it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None:
        with contextlib.suppress(OSError):  # a kernel without THP: ordinary pages
            buf.madvise(advise)
    # frombuffer keeps `buf` alive as long as a tensor views it
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return t.zero_()  # anonymous memory reads as zeros; the write commits it now
