"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): for the requests that ask, the
logprob of each prompt token given the ones before it, with its rank and the top k.

The row at position p predicts the token at p + 1, so a prefill chunk [start, end) yields the
entries of prompt positions start + 1 .. min(end, len(prompt) - 1); the scheduler joins the
chunks. Only the asking requests' prompt rows go through the LM head, in slices of rows that
bound the float32 logits to _SLICE_BYTES (a 2048-token chunk of a 150k vocabulary would be
1.2 GiB at once). Every tensor-parallel rank runs it (the LM head gathers the vocabulary
shards with a collective); only the driver keeps the result.

The step graphs (the CPU decode plan, CUDA graphs) return the final hidden state of every row
like the eager forward, so this reads the same rows whichever ran the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.outputs import ScheduledRequest, TokenLogprobs

_SLICE_BYTES = 64 << 20  # float32 logits (and their log_softmax) per slice of rows


def compute_prompt_logprobs(
    model: Any,
    hidden: torch.Tensor,
    scheduled: list[ScheduledRequest],
    last_row: dict[str, int],
    requests: dict[str, Any],
    vocab_size: int,
    keep: bool = True,
    head_rows: Callable[[list[int]], list[int]] | None = None,
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """{request id: (position of the first entry's token, entries)} for this step's rows.
    keep=False (ranks other than the driver): run the LM head's collectives, return {}.
    head_rows: called with each slice's rows before its LM-head call (LoRA's adapters)."""
    jobs: list[tuple[str, int, list[int], int]] = []  # (rid, start_pos, targets, k)
    rows: list[int] = []
    for r in scheduled:
        state = requests[r.request_id]
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        prompt = state.prompt_token_ids
        stop = min(r.start_pos + r.num_tokens, len(prompt) - 1)
        if stop <= r.start_pos:
            continue  # a chunk past the prompt (a decode), or a one-token prompt
        first = last_row[r.request_id] - r.num_tokens + 1
        rows.extend(range(first, first + stop - r.start_pos))
        jobs.append((r.request_id, r.start_pos, prompt[r.start_pos + 1 : stop + 1], k))
    if not jobs:
        return {}
    targets = [t for _, _, tgt, _ in jobs for t in tgt]
    k_max = max(k for *_, k in jobs)
    chosen_l: list[float] = []
    rank_l: list[int] = []
    top_v_l: list[list[float]] = []
    top_i_l: list[list[int]] = []
    row_t = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    tgt_t = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    step = max(1, _SLICE_BYTES // (8 * vocab_size))
    for lo in range(0, len(rows), step):
        hi = min(lo + step, len(rows))
        if head_rows is not None:
            head_rows(rows[lo:hi])
        logits = model.compute_logits(hidden.index_select(0, row_t[lo:hi]))
        if not keep:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        del logits
        chosen = lp.gather(1, tgt_t[lo:hi, None])
        rank = (lp > chosen).sum(-1) + 1  # vLLM's: 1 + the number of more likely tokens
        chosen_l += chosen[:, 0].tolist()
        rank_l += rank.tolist()
        if k_max:
            top_v, top_i = lp.topk(k_max, dim=-1)
            top_v_l += top_v.tolist()
            top_i_l += top_i.tolist()
    if not keep:
        return {}
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    j = 0
    for rid, start, tgt, k in jobs:
        entries = []
        for t in tgt:
            top = list(zip(top_i_l[j][:k], top_v_l[j][:k], strict=True)) if k else []
            entries.append(TokenLogprobs(token_id=t, logprob=chosen_l[j], rank=rank_l[j], top=top))
            j += 1
        out[rid] = (start + 1, entries)
    return out
