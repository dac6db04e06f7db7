"""Pooling in the model runner: a pooling request's prompt chunks run through the same
forward as any prefill, and their final-normed hidden rows (the step graphs return the same
rows as the eager forward) are folded into the request's PoolingState chunk by chunk, so
chunked prefill gives the vector of the whole prompt:

    LAST  the row of the prompt's last position (the chunk that ends the prompt)
    MEAN  the running float32 sum of every row, divided by the prompt length at the end
    CLS   the row of position 0 (the first chunk)

When the chunk that ends the prompt has run, the vector is cut to `dimensions` (Matryoshka),
L2-normalized if asked, and handed back on the CPU (ModelRunnerOutput.pooled). A preempted
request comes back as new, with a fresh state (it is recomputed from position 0). MEAN and
CLS never start past 0: the KV cache manager gives them no prefix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.outputs import ScheduledRequest
from engine.pooling_params import PoolingParams


@dataclass(slots=True)
class PoolingState:
    """A pooling request's partial result across its prompt's chunks."""

    total: torch.Tensor | None = None  # MEAN: the sum of the rows so far (float32)
    first: torch.Tensor | None = None  # CLS: position 0's row (a copy: hidden is reused)


def pool_step(
    hidden: torch.Tensor,
    scheduled: list[ScheduledRequest],
    last_row: dict[str, int],
    requests: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """Fold this step's rows into each pooling request's state; {request id: vector} for
    the requests whose prompt this step finished."""
    out: dict[str, torch.Tensor] = {}
    for r in scheduled:
        state = requests[r.request_id]
        params: PoolingParams | None = state.pooling_params
        if params is None:
            continue
        last = last_row[r.request_id]
        rows = hidden[last - r.num_tokens + 1 : last + 1]
        acc: PoolingState = state.pooling
        kind = params.pooling_type
        if kind == "MEAN":
            part = rows.sum(0, dtype=torch.float32)
            acc.total = part if acc.total is None else acc.total + part
        elif kind == "CLS" and r.start_pos == 0:
            acc.first = rows[0].to(torch.float32, copy=True)
        if not r.sample:  # a chunk short of the prompt's end
            continue
        if kind == "LAST":
            vector = rows[-1].float()
        elif kind == "MEAN":
            vector = acc.total / len(state.prompt_token_ids)
        else:
            vector = acc.first
        out[r.request_id] = finish_vector(vector, params)
    return out


def finish_vector(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """The first `dimensions` values (Matryoshka), then L2-normalized where asked; a float32
    copy on the CPU."""
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector.to("cpu", torch.float32, copy=True)
