"""BlockPool: the physical KV blocks, their reference counts and the prefix-cache index.

It knows blocks, not requests (KVCacheManager) nor tokens (Scheduler).

Eviction order. A block whose ref count drops to 0 goes back to the free queue, but keeps
its hash and its K/V: it stays a prefix-cache hit until it is reused ("lazy eviction": the
hash entry is dropped only when get_new_blocks hands the block out again). Free blocks
without a hash hold nothing reusable, so free_blocks puts them at the head of the queue
(reused first, most recently freed first), and cached blocks at the tail (reused last, least
recently freed first: LRU). Callers free a request's blocks in reverse order, so the tail
of a hash chain is evicted before its head, and a shorter prefix survives longer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.core.kv_cache_utils import BlockHash, FreeBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from engine.request import Request

# block_states() codes, one byte per block.
BLOCK_FREE = 0
BLOCK_USED = 1
BLOCK_CACHED = 2  # free, but still a prefix-cache hit


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # Block 0 is never handed out: block tables can be padded with it.
        self.null_block = self.free_block_queue.popleft()
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable (non-null) blocks referenced by some request, 0..1."""
        usable = self.num_blocks - 1
        return (usable - self.free_block_queue.num_free_blocks) / usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks from the head of the free queue, evicting their cached hashes."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, only {queue.num_free_blocks} are free"
            )
        out = []
        for _ in range(num_blocks):
            block = queue.popleft()
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (free ones leave the queue)."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; pass a request's blocks in reverse (see module doc)."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under request.block_hashes.

        Those blocks must be full and their K/V computed. A block already cached (a prefix
        hit) is skipped; so is one whose hash another block already holds (the same prefix
        computed twice concurrently): that duplicate stays unhashed and is reused first.
        """
        if not self.enable_caching:
            return
        hashes = request.block_hashes
        index = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is self.null_block:
                continue  # cached already; or dropped behind a sliding window
            block_hash = hashes[i]
            if block_hash not in index:
                block.block_hash = block_hash
                index[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def block_states(self) -> bytearray:
        """One byte per block id: BLOCK_FREE, BLOCK_USED or BLOCK_CACHED (the null block
        counts as used). O(num_blocks): for the admin console, not the step loop."""
        states = bytearray(self.num_blocks)
        for block in self.blocks:
            if block.ref_cnt > 0 or block is self.null_block:
                states[block.block_id] = BLOCK_USED
            elif block.block_hash is not None:
                states[block.block_id] = BLOCK_CACHED
        return states
