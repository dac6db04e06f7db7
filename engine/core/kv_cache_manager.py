"""KVCacheManager: each request's block table, prefix-cache lookups and copy-on-write forks.

It knows requests and their blocks; the BlockPool knows blocks; the Scheduler knows tokens.

A block is registered in the prefix cache only once its K/V is computed, i.e. for full
blocks below request.num_computed_tokens after the step that computed them (cache_blocks,
called by the scheduler from update_from_output). A request admitted in the same step can
therefore never hit a block whose K/V the current forward is still writing.

Sliding window (vLLM v1's SlidingWindowManager, for a model whose every layer has a window;
sliding_window is the largest). Before a request's next tokens are allocated, its blocks
wholly before the window of its first new token (positions < num_computed - window + 1) go
back to the pool and the null block takes their place in its table: a long request holds
at most ceil(window / block_size) + 1 blocks past a decode step (+ its chunk's). No kernel
reads them (engine.attention: each row starts at the block of its first key in the window).
A hybrid model (some global layers) passes no window: every block is kept, the simplest
correct choice (vLLM's hybrid allocator, one table per attention type, is not done).

Prefix caching stays exact: a dropped block that was cached keeps its hash and K/V until
the pool reuses it (as any freed block does), and a hit is still a chain from the prompt's
first block with every block of it cached. A hit's leading blocks that are already out of
the new request's window are not taken (the null block stands in for them). A block dropped
before it was cached is never cached, and breaks the chain there. (vLLM also serves a hit
whose early blocks were evicted, as long as the window's blocks are cached; not done.)
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import KVCacheBlock, extend_block_hashes
from engine.request import Request


def blocks_per_request(
    max_model_len: int,
    block_size: int,
    sliding_window: int | None = None,
    max_chunk: int | None = None,
) -> int:
    """The most blocks one request holds at once (block 0 not counted): its whole context;
    under a sliding window on every layer with chunked prefill (chunks of at most max_chunk
    tokens), the window behind a chunk and the chunk, wherever they fall on the blocks."""
    full = -(-max_model_len // block_size)
    if sliding_window is None or max_chunk is None:
        return full
    span = sliding_window - 1 + max_chunk  # positions from the first key to the last query
    return min(full, (span + block_size - 2) // block_size + 1)


class NoFreeBlocksError(RuntimeError):
    """fork() found no free block for the copy-on-write of a partial last block."""


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Every layer's window (the largest): blocks behind it are dropped; None: all kept.
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Block ids per request, the same list object for the request's life: the model
        # runner keeps a reference and sees appended blocks without a copy.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Sliding window: how many leading blocks of each request are dropped (null).
        self.num_dropped_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._taken = PrefixCacheStats()

    # -- queries ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def block_states(self) -> bytearray:
        return self.block_pool.block_states()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (shared list, appended in place; [] if it has none)."""
        return self.req_to_block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks that prefixes request.all_token_ids.

        The hit is capped so that at least the last token is recomputed (its logits are
        needed to sample): a prompt that hits entirely gives up its last block.
        Pure lookup: no reference is taken (allocate_slots does that) and no stats change.
        A request that asks for prompt logprobs computes its whole prompt: no hit (vLLM's);
        so does a pooling request that pools more than the last row (mean, CLS): the rows a
        hit skips would be missing from its vector. Last-token pooling takes the hit (the
        cap above recomputes the last position).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        pooling = request.pooling_params
        if pooling is not None and pooling.needs_every_position:
            return [], 0
        extend_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -- allocation ---------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the computed ones.

        new_computed_blocks: a prefix hit from get_computed_blocks (only for a request that
        holds no blocks yet); they come before request.num_computed_tokens' tokens.
        Returns the newly allocated blocks, or None when they do not fit: nothing changes
        then and the caller must preempt someone (or wait); under a sliding window the blocks
        behind it are dropped first either way (no later step reads them).
        """
        rid = request.request_id
        bs = self.block_size
        blocks = self.req_to_blocks.get(rid)
        hits = new_computed_blocks or ()
        num_held = len(blocks) if blocks is not None else 0
        num_computed = request.num_computed_tokens + len(hits) * bs
        num_tokens = num_computed + num_new_tokens
        num_new = -(-num_tokens // bs) - num_held - len(hits)
        num_skipped_hits = 0
        if self.sliding_window is not None:
            num_skipped = max(0, num_computed - self.sliding_window + 1) // bs
            if blocks is not None:
                self._drop_blocks(rid, blocks, num_skipped)
            num_skipped_hits = min(num_skipped, len(hits))
        if num_new <= 0 and not hits:
            return []  # the decode fast path: the last block still has room
        pool = self.block_pool
        taken = hits[num_skipped_hits:]  # the hits out of the window are not taken
        # Free hit blocks leave the free queue when touched: they are not free space.
        num_free = pool.num_free_blocks - sum(1 for b in taken if b.ref_cnt == 0)
        if num_new > num_free:
            return None
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
            self.req_to_block_ids[rid] = []
            self.num_cached_blocks[rid] = 0
            if self.sliding_window is not None:
                self.num_dropped_blocks[rid] = 0
        block_ids = self.req_to_block_ids[rid]
        if hits:
            assert num_held == 0, "a prefix hit is only allowed for a request with no blocks"
            pool.touch(taken)
            if num_skipped_hits:
                blocks.extend([pool.null_block] * num_skipped_hits)
                block_ids.extend([pool.null_block.block_id] * num_skipped_hits)
                self.num_dropped_blocks[rid] = num_skipped_hits
            blocks.extend(taken)
            block_ids.extend(b.block_id for b in taken)
            self.num_cached_blocks[rid] = len(hits)
        new_blocks = pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new_blocks)
        block_ids.extend(b.block_id for b in new_blocks)
        self.cache_blocks(request)
        return new_blocks

    def _drop_blocks(self, rid: str, blocks: list[KVCacheBlock], num_skipped: int) -> None:
        """Free the request's blocks [dropped so far, num_skipped) and put the null block in
        their places (the model runner's table still names them: no kernel reads them)."""
        first = self.num_dropped_blocks[rid]
        end = min(num_skipped, len(blocks))
        if end <= first:
            return
        pool = self.block_pool
        null = pool.null_block
        block_ids = self.req_to_block_ids[rid]
        # Tail first, as free() does: the chain's head outlives its tail in the cache.
        pool.free_blocks(blocks[i] for i in range(end - 1, first - 1, -1))
        for i in range(first, end):
            blocks[i] = null
            block_ids[i] = null.block_id
        self.num_dropped_blocks[rid] = end

    def num_held_blocks(self, request_id: str) -> int:
        """The blocks the request holds (its table's entries that are not the null block)."""
        blocks = self.req_to_blocks.get(request_id, ())
        return len(blocks) - self.num_dropped_blocks.get(request_id, 0)

    def cache_blocks(self, request: Request, num_computed: int | None = None) -> None:
        """Register the request's full blocks whose K/V is computed (incremental, cheap):
        those in its first num_computed tokens (default: num_computed_tokens; with async
        scheduling that counts a step still in flight, whose tokens may not be known)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_full = num_computed // self.block_size
        num_cached = self.num_cached_blocks.get(rid)
        if num_cached is None or num_full <= num_cached:
            return
        blocks = self.req_to_blocks[rid]
        num_full = min(num_full, len(blocks))
        if len(request.block_hashes) < num_full:
            extend_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see BlockPool's eviction order)."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_ids.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        num_dropped = self.num_dropped_blocks.pop(rid, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[num_dropped:]))

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give child the parent's computed blocks for n > 1 sampling.

        Full blocks are shared (ref count + 1). A partially filled last block gets a fresh
        block for the child, and (src_block_id, dst_block_id) is returned: the runner copies
        it before the next forward (copy-on-write). None: nothing to copy.
        Raises NoFreeBlocksError, changing nothing, when no block is free for the copy.
        """
        cid = child.request_id
        if cid in self.req_to_blocks:
            raise ValueError(f"request {cid!r} already holds blocks")
        parent_blocks = self.req_to_blocks[parent.request_id]
        num_computed = parent.num_computed_tokens
        num_full = num_computed // self.block_size
        partial = num_computed % self.block_size != 0
        pool = self.block_pool
        if partial and pool.num_free_blocks < 1:
            raise NoFreeBlocksError(f"no free block to fork {cid!r}")
        shared = parent_blocks[:num_full]
        num_dropped = min(self.num_dropped_blocks.get(parent.request_id, 0), num_full)
        pool.touch(shared[num_dropped:])  # the dropped ones are the null block: not counted
        blocks = list(shared)
        copy = None
        if partial:
            new_block = pool.get_new_blocks(1)[0]
            copy = (parent_blocks[num_full].block_id, new_block.block_id)
            blocks.append(new_block)
        self.req_to_blocks[cid] = blocks
        self.req_to_block_ids[cid] = [b.block_id for b in blocks]
        self.num_cached_blocks[cid] = min(self.num_cached_blocks[parent.request_id], num_full)
        if self.sliding_window is not None:
            self.num_dropped_blocks[cid] = num_dropped
        # The computed tokens are common to both, so are the hashes of their full blocks.
        if len(child.block_hashes) < num_full:
            child.block_hashes = parent.block_hashes[:num_full]
        return copy

    # -- prefix-cache statistics and admin ----------------------------------------------

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (the scheduler calls it once per request)."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def take_prefix_stats(self) -> PrefixCacheStats:
        """Queries and hits since the previous call (for counters that add deltas)."""
        delta = PrefixCacheStats(
            self.prefix_cache_queries - self._taken.queries,
            self.prefix_cache_hits - self._taken.hits,
        )
        self._taken = PrefixCacheStats(self.prefix_cache_queries, self.prefix_cache_hits)
        return delta

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
