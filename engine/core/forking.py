"""n > 1 sampling: one parent request forks into n samples once its prompt is computed.

The parent runs alone until then, holding n seats of max_num_seqs; the runner samples n
tokens from it (ScheduledRequest.num_samples) and samples 1..n-1 become child requests
"<id>#<i>". The scheduler gives each child the parent's blocks (KVCacheManager.fork). The
runner keeps the parent's first token; each child reaches it as a new request (NewRequestData
with the shared prompt and its own first token as output), its table the shared full blocks
plus the copied partial one. A structured-output child copies the parent's grammar state
before either takes its token: the n first tokens were drawn from one masked row.
"""

from __future__ import annotations

import dataclasses

from engine.core.stop import check_stop
from engine.outputs import RequestUpdate, TokenLogprobs
from engine.request import Request


def seats(request: Request) -> int:
    """Running slots a request takes: an n > 1 parent reserves its children's until it forks."""
    n = request.sampling_params.n
    return n if n > 1 and request.parent_id is None and not request.output_token_ids else 1


def child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}#{index}"


def make_child(parent: Request, index: int) -> Request:
    """Sample `index` (1..n-1) of an n > 1 parent: same prompt, n=1, seed + index."""
    params = parent.sampling_params
    child = Request(
        request_id=child_id(parent.request_id, index),
        prompt_token_ids=parent.prompt_token_ids,
        sampling_params=dataclasses.replace(
            params,
            n=1,
            seed=params.seed + index if params.seed is not None else None,
            prompt_logprobs=None,  # the parent's output carries them
        ),
        eos_token_id=parent.eos_token_id,
        arrival_time=parent.arrival_time,
        priority=parent.priority,
        cache_salt=parent.cache_salt,
        tenant=parent.tenant,
        tenant_weight=parent.tenant_weight,
        deadline=parent.deadline,
        lora_request=parent.lora_request,
        parent_id=parent.request_id,
        sample_index=index,
    )
    child.num_cached_tokens = parent.num_cached_tokens
    child.first_scheduled_time = parent.first_scheduled_time
    if parent.grammar is not None:  # its own matcher, from the parent's (pre-token) state
        child.grammar = parent.grammar.fork()
    child.num_charged_prompt_tokens = parent.num_charged_prompt_tokens
    return child


def fork_samples(
    parent: Request, tokens: list[int], lps: list[TokenLogprobs] | None, max_model_len: int
) -> tuple[list[Request], list[RequestUpdate]]:
    """Children 1..n-1 of `parent`, each with its first sampled token (tokens[i - 1]).

    Returns the children still unfinished, which the scheduler must start, and one update
    per child. A child that finishes on its first token is never started: it holds no blocks.
    """
    live, updates = [], []
    for i, token in enumerate(tokens, start=1):
        child = make_child(parent, i)
        child.append_output_token(token)
        if not check_stop(child, max_model_len):
            live.append(child)
        updates.append(
            RequestUpdate(
                child.request_id,
                parent.request_id,
                i,
                [token],
                lps[i - 1 : i] if lps else None,
                child.finish_reason,
                child.stop_reason,
                child.num_cached_tokens,
            )
        )
    return live, updates
