"""A step's attention inputs in one flat, backend-neutral form: CommonAttentionMetadata.

The flattened batch holds decode tokens first (one query token per request, sorted by context
length), then prefill chunks (several query tokens each). Every backend
(engine.attention.backends) builds its own metadata from this: index tensors, masks, kernel
tables. The tensors here are host (CPU) tensors; a backend copies what it needs to its
device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# A slot that writes nowhere: the padding rows of a captured graph (the triton backend's store
# skips negative slots; block tables pad with block 0, which is never handed out).
PAD_SLOT_ID = -1

# One request's part of a step as the model runner has it: (start_pos, num_tokens, block_ids).
# block_ids: the request's physical blocks in order, a list or a 1-D int32 numpy array.
SeqSpec = tuple[int, int, Sequence[int] | np.ndarray]


@dataclass(slots=True)
class CommonAttentionMetadata:
    """What every backend needs, nothing backend-specific (no masks, no kernel tables)."""

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]: request r's rows [qsl[r], qsl[r+1])
    seq_lens: torch.Tensor  # int32 [num_reqs]: keys request r attends (cached + this step)
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks], padded with block 0 (reserved)
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot each token's K/V is written to
    block_size: int
    num_reqs: int
    num_actual_tokens: int
    num_decodes: int  # the leading requests with one query token
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    # The same on the host as numpy, for backends building their tables there: int64 copies
    # of the offsets and lengths, the block table's own memory.
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    block_table_np: np.ndarray

    @property
    def query_lens_np(self) -> np.ndarray:
        return np.diff(self.query_start_loc_np)

    @property
    def start_positions_np(self) -> np.ndarray:
        """int64 [num_reqs]: the position of each request's first query token."""
        return self.seq_lens_np - self.query_lens_np


def _block_table(seqs: Sequence[SeqSpec], need: list[int], width: int) -> np.ndarray:
    """int32 [num_reqs, width]: each request's first need[r] block ids, then block 0."""
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for r, (s, k) in enumerate(zip(seqs, need, strict=True)):
        if len(s[2]) < k:
            raise ValueError(
                f"request {r} needs {k} blocks of its context but has only {len(s[2])} blocks"
            )
    if len(seqs) > 1 and not isinstance(seqs[0][2], np.ndarray):
        # Python lists: one conversion of all ids at once beats one per row.
        ids = itertools.chain.from_iterable(
            s[2] if len(s[2]) == k else s[2][:k] for s, k in zip(seqs, need, strict=True)
        )
        flat = np.fromiter(ids, dtype=np.int32, count=sum(need))
        table[np.arange(width)[None, :] < np.array(need)[:, None]] = flat
        return table
    for r, (s, k) in enumerate(zip(seqs, need, strict=True)):
        table[r, :k] = s[2][:k]
    return table


def common_metadata_from_seqs(seqs: Sequence[SeqSpec], block_size: int) -> CommonAttentionMetadata:
    """seqs: (start_pos, num_tokens, block_ids) per request, in flattened-batch order; decodes
    (num_tokens == 1) come first, sorted by start_pos ascending."""
    bs = block_size
    num_reqs = len(seqs)
    # Per-request numbers in plain Python (a step has at most a few hundred requests: cheaper
    # than numpy's per-call cost at small batches), per-token and per-block ones in numpy.
    counts = [s[1] for s in seqs]
    seq_lens = [s[0] + s[1] for s in seqs]
    num_decodes = next((i for i, c in enumerate(counts) if c != 1), num_reqs)
    max_seq_len = max(seq_lens, default=0)
    table = _block_table(seqs, [-(-n // bs) for n in seq_lens], -(-max_seq_len // bs))
    qsl = np.array([0, *itertools.accumulate(counts)], dtype=np.int64)
    seq_lens_np = np.array(seq_lens, dtype=np.int64)
    num_tokens = int(qsl[-1])
    if num_decodes == num_reqs:  # one token each, at its start position
        req_of_token, pos = np.arange(num_reqs), seq_lens_np - 1
    else:
        req_of_token = np.repeat(np.arange(num_reqs), counts)
        pos = (
            np.arange(num_tokens)
            - qsl[:-1][req_of_token]
            + (seq_lens_np - np.diff(qsl))[req_of_token]
        )
    slots = table[req_of_token, pos // bs].astype(np.int64) * bs + pos % bs
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)),
        block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots),
        block_size=bs,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=max(counts, default=0),
        max_seq_len=max_seq_len,
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens_np,
        block_table_np=table,
    )
