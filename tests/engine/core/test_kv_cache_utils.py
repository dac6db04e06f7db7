from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from core_testing import make_request

from engine.core.kv_cache_utils import (
    NONE_HASH,
    FreeBlockQueue,
    KVCacheBlock,
    extend_block_hashes,
    hash_block_tokens,
)

REPO = Path(__file__).resolve().parents[3]


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


# -- FreeBlockQueue ------------------------------------------------------------------------


def test_free_queue_initial_order_and_popleft():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == len(queue) == 5
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    assert ids(queue) == [1, 2, 3, 4]
    assert queue.num_free_blocks == 4


def test_free_queue_remove_from_middle_head_and_tail():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[3])  # middle
    assert ids(queue) == [0, 1, 2, 4, 5]
    assert blocks[2].next_free is blocks[4] and blocks[4].prev_free is blocks[2]
    queue.remove(blocks[0])  # head
    queue.remove(blocks[5])  # tail
    assert ids(queue) == [1, 2, 4]
    assert queue.num_free_blocks == 3
    assert queue.popleft() is blocks[1]


def test_free_queue_append_and_appendleft():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks[:2])
    queue.append(blocks[2])
    queue.appendleft(blocks[3])
    queue.append(blocks[4])
    assert ids(queue) == [3, 0, 1, 2, 4]
    assert queue.num_free_blocks == 5
    assert [queue.popleft().block_id for _ in range(5)] == [3, 0, 1, 2, 4]
    assert queue.num_free_blocks == 0


def test_free_queue_empty_popleft_raises():
    queue = FreeBlockQueue([])
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    block = KVCacheBlock(7)
    queue.appendleft(block)
    assert queue.popleft() is block
    with pytest.raises(ValueError):
        queue.popleft()


def test_block_repr_does_not_follow_links():
    blocks = [KVCacheBlock(i) for i in range(3)]
    FreeBlockQueue(blocks)
    assert repr(blocks[1]) == "KVCacheBlock(block_id=1, ref_cnt=0, block_hash=None)"


# -- hashing -------------------------------------------------------------------------------


def test_hash_encoding_is_pinned():
    """The digest is sha256(parent || u32 count || int32 tokens || extra): pinned so that a
    change to the encoding (which invalidates any persisted cache) is deliberate."""
    tokens = [1, 2, 3, 4]
    expected = hashlib.sha256(
        NONE_HASH + struct.pack("<I", 4) + array("i", tokens).tobytes() + b"salt"
    ).digest()
    assert hash_block_tokens(None, tokens, b"salt") == expected
    assert len(expected) == 32


def test_hash_chains_over_parents_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))  # any sequence type
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert a != hash_block_tokens(None, [1, 2, 3, 4], b"x")
    b1 = hash_block_tokens(a, [5, 6, 7, 8])
    b2 = hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert b1 != b2, "same block tokens under a different prefix must not collide"
    # The count prefix keeps tokens and extra keys apart.
    assert hash_block_tokens(None, [1], b"\x02\x00\x00\x00") != hash_block_tokens(None, [1, 2])


def test_extend_block_hashes_is_incremental_over_full_blocks():
    bs = 4
    req = make_request("r", list(range(10)))
    extend_block_hashes(req, bs)
    assert len(req.block_hashes) == 2  # 10 tokens: two full blocks, the partial one is not hashed
    first = list(req.block_hashes)
    assert first[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert first[1] == hash_block_tokens(first[0], [4, 5, 6, 7])
    req.append_output_token(10)
    extend_block_hashes(req, bs)
    assert req.block_hashes == first  # 11 tokens: still two
    req.append_output_token(11)
    extend_block_hashes(req, bs)
    assert req.block_hashes[:2] == first
    assert req.block_hashes[2] == hash_block_tokens(first[1], [8, 9, 10, 11])
    # Same result as hashing the whole sequence at once.
    whole = make_request("w", list(range(12)))
    extend_block_hashes(whole, bs)
    assert whole.block_hashes == req.block_hashes


def test_cache_salt_isolates_every_block():
    tokens = list(range(32))
    plain, a1, a2, b = (
        make_request("p", tokens),
        make_request("a1", tokens, cache_salt="tenant-a"),
        make_request("a2", tokens, cache_salt="tenant-a"),
        make_request("b", tokens, cache_salt="tenant-b"),
    )
    for req in (plain, a1, a2, b):
        extend_block_hashes(req, 8)
    assert a1.block_hashes == a2.block_hashes
    for i in range(4):  # the salt enters the first block, the chain carries it on
        assert len({plain.block_hashes[i], a1.block_hashes[i], b.block_hashes[i]}) == 3
    assert a1.block_hashes[0] == hash_block_tokens(None, tokens[:8], b"tenant-a")
    assert a1.block_hashes[1] == hash_block_tokens(a1.block_hashes[0], tokens[8:16])


def test_hashes_are_stable_across_processes():
    """No dependence on Python's per-process hash seed: a restarted server (or another
    rank) computes the same digests."""
    # Load the module file alone (stdlib only), not the engine package and what it imports.
    path = REPO / "engine" / "core" / "kv_cache_utils.py"
    code = (
        "import importlib.util as u, sys;"
        f"s = u.spec_from_file_location('kvu', {str(path)!r}); m = u.module_from_spec(s);"
        "sys.modules['kvu'] = m; s.loader.exec_module(m); h = m.hash_block_tokens;"
        "print(h(h(None, [5, 6, 7], b's'), [8, 9]).hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    expected = hash_block_tokens(hash_block_tokens(None, [5, 6, 7], b"s"), [8, 9]).hex()
    assert out.stdout.strip() == expected
