"""KV-cache building blocks: the block record, the free-block queue and block hashing.

Block hashing. A full block's hash is a SHA-256 digest of (parent block's digest, the block's
token ids, extra keys), so it names the whole token prefix up to the block's end, not just the
block. The per-request ``cache_salt`` is mixed into the first block only, which makes every
later block of a salted request differ from an unsalted (or differently salted) one: tenants
never share cache entries. A request's LoRA adapter is mixed in the same way (its
LoRARequest.cache_key, before the salt): blocks are never shared across adapters or with the
base model. Because the digest is cryptographic and covers the full chain,
two different prefixes never map to the same hash in practice (a collision would be a
SHA-256 collision), so a hash hit needs no token-by-token check. Digests are stable across
processes and restarts (no PYTHONHASHSEED dependence).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request

BlockHash = bytes

# Parent of a request's first block: a fixed, versioned seed instead of "no parent".
NONE_HASH: BlockHash = hashlib.sha256(b"tessera-kv-cache-v1").digest()
_COUNT = struct.Struct("<I")  # token count prefix: keeps (tokens, extra_keys) unambiguous


def hash_block_tokens(
    parent_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: bytes | None = None,
) -> BlockHash:
    """Digest of one full block chained to its parent's digest (None: the first block)."""
    data = (
        (parent_hash if parent_hash is not None else NONE_HASH)
        + _COUNT.pack(len(block_token_ids))
        + array("i", block_token_ids).tobytes()
    )
    if extra_keys:
        data += extra_keys
    return hashlib.sha256(data).digest()


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Append hashes for the full blocks of request.all_token_ids not hashed yet.

    Incremental: call it after tokens are appended; earlier hashes are never recomputed.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    start = len(hashes)
    if start >= num_full:
        return
    parent = hashes[-1] if hashes else None
    salt = request.cache_salt.encode() if request.cache_salt else None
    if request.lora_request is not None:
        salt = request.lora_request.cache_key + (salt or b"")
    for i in range(start, num_full):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block, salt if i == 0 else None)
        hashes.append(parent)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of the KV cache. Identity (not value) equality: it is a node."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, computed block registered in the prefix cache.
    block_hash: BlockHash | None = None
    # Links of the free-block queue; None while the block is not in it.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks, between two sentinel nodes.

    Every operation is O(1), including remove() of a block in the middle (a prefix-cache
    hit on a free, cached block). The head is evicted (reused) first.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Insert at the tail: reused last."""
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Insert at the head: reused first."""
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; O(n), for tests and the admin console only."""
        out = []
        node = self._head.next_free
        while node is not self._tail:
            out.append(node)
            node = node.next_free
        return out
