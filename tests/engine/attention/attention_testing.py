"""Shared by the attention kernel tests: the mixed step they all run."""

from __future__ import annotations

import random


def mixed_step(
    rng: random.Random, block_size: int, num_blocks: int
) -> tuple[list[tuple[int, int, list[int]]], int]:
    """(seqs for common_metadata_from_seqs, rows before the fresh prompt): 13 decodes
    sorted by context (1-150 tokens), then prefill chunks: positions 10-16 of a prompt whose
    first 10 tokens are cached, and a fresh 23-token prompt; blocks scattered over the cache."""
    bs = block_size
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    ctx = sorted(rng.randint(1, 150) for _ in range(13))
    seqs = [(c - 1, 1, [free.pop() for _ in range(-(-c // bs))]) for c in ctx]
    seqs.append((10, 7, [free.pop() for _ in range(-(-17 // bs))]))
    seqs.append((0, 23, [free.pop() for _ in range(-(-23 // bs))]))
    return seqs, len(ctx) + 7


def drop_blocks_before_window(
    seqs: list[tuple[int, int, list[int]]], window: int, block_size: int
) -> tuple[list[tuple[int, int, list[int]]], list[int]]:
    """What the KV cache manager leaves of a step's block tables under a sliding window: a
    request's blocks wholly before its first query's window (positions < start - window + 1)
    are freed. -> (the seqs, those entries replaced by the null block 0 on every other
    request and kept on the rest; the dropped blocks' ids, for a test to poison: a kernel
    that reads one at all, even masked, then gives NaN)."""
    out, dropped = [], []
    for r, (start, n, ids) in enumerate(seqs):
        gone = max(0, start - window + 1) // block_size
        dropped += ids[:gone]
        out.append((start, n, [0] * gone + list(ids[gone:]) if r % 2 == 0 else list(ids)))
    return out, dropped
