"""Apply a grammar's token bitmask to logits rows: plain torch, so the CPU sampler and the
sync-free GPU sampler share it (no grammar library on the device machine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


@dataclass(slots=True)
class RowMask:
    """A step's grammar masks for the sampler: bitmask[i] applies to the request at
    position rows[i] of the step's sampling list."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], on the host


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] -> bool [R, vocab_size]: True where the token is allowed."""
    bits = _BITS.get(bitmask.device)
    if bits is None:
        bits = _BITS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits).bitwise_and_(1).view(bitmask.shape[0], -1)
    return allowed[:, :vocab_size].bool()


def apply_token_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: x[rows[i], t] = -inf wherever bit t of bitmask[i] is clear. Other rows are
    untouched. rows: int64 [R] on x's device; bitmask: int32 [R, ceil(V / 32)]."""
    v = x.shape[1]
    assert bitmask.shape[1] * 32 >= v, "the bitmask is narrower than the vocabulary"
    allowed = unpack_bitmask(bitmask.to(x.device, non_blocking=True), v)
    sub = x.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    x.index_copy_(0, rows, sub)
