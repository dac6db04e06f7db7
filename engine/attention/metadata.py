"""A step's attention inputs in one flat, backend-neutral form: CommonAttentionMetadata.

The flattened batch holds decode tokens first (one query token per request, sorted by context
length), then prefill chunks (several query tokens each). Every backend
(engine.attention.backends) builds its own metadata from this: index tensors, masks, kernel
tables. The tensors here are host (CPU) tensors; a backend copies what it needs to its
device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

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

    @property
    def query_lens(self) -> np.ndarray:
        qsl = self.query_start_loc.numpy()
        return (qsl[1:] - qsl[:-1]).astype(np.int64)

    @property
    def start_positions(self) -> np.ndarray:
        """int64 [num_reqs]: the position of each request's first query token."""
        return self.seq_lens.numpy().astype(np.int64) - self.query_lens


def common_metadata_from_seqs(seqs: Sequence[SeqSpec], block_size: int) -> CommonAttentionMetadata:
    """seqs: (start_pos, num_tokens, block_ids) per request, in flattened-batch order; decodes
    (num_tokens == 1) come first, sorted by start_pos ascending."""
    bs = block_size
    num_reqs = len(seqs)
    starts = np.fromiter((s[0] for s in seqs), dtype=np.int64, count=num_reqs)
    counts = np.fromiter((s[1] for s in seqs), dtype=np.int64, count=num_reqs)
    seq_lens = starts + counts
    num_decodes = 0
    while num_decodes < num_reqs and counts[num_decodes] == 1:
        num_decodes += 1
    max_seq_len = int(seq_lens.max()) if num_reqs else 0
    blocks_needed = -(-seq_lens // bs)
    table = np.zeros((num_reqs, -(-max_seq_len // bs)), dtype=np.int32)
    for r, (_, _, ids) in enumerate(seqs):
        need = int(blocks_needed[r])
        if len(ids) < need:
            raise ValueError(
                f"request {r} attends {int(seq_lens[r])} tokens but has only {len(ids)} blocks "
                f"of {bs}"
            )
        table[r, :need] = ids[:need]
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    num_tokens = int(qsl[-1])
    req_of_token = np.repeat(np.arange(num_reqs), counts)
    pos = np.arange(num_tokens) - qsl[:-1][req_of_token] + starts[req_of_token]
    slots = table[req_of_token, pos // bs].astype(np.int64) * bs + pos % bs
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots),
        block_size=bs,
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        max_query_len=int(counts.max()) if num_reqs else 0,
        max_seq_len=max_seq_len,
    )
