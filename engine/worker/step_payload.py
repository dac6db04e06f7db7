"""The bytes the driver sends a tensor-parallel worker each step: msgpack via msgspec.

One step's payload is its SchedulerOutput plus the driver's sampled tokens of the previous
step (the workers do not sample, so that is how they learn them). Each scheduled request is a
flat array (id, start, count, new block ids, sample, num_samples, drafts), not a map of field names;
prompts and sampling params travel once, in NewRequestData. So a decode step costs O(batch)
bytes whatever the context length (test: tests/engine/worker/test_step_payload.py).
"""

from __future__ import annotations

import msgspec

from engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput

_Scheduled = tuple[str, int, int, list[int], bool, int, list[int]]
_Step = tuple[
    list[_Scheduled],  # scheduled
    int,  # num_batched_tokens
    list[NewRequestData],
    list[tuple[int, int]],  # blocks_to_copy
    list[str],  # finished_request_ids
    list[str],  # preempted_request_ids
    dict[str, list[int]],  # the previous step's sampled tokens
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Step)


def encode_step(so: SchedulerOutput, prev_sampled: dict[str, list[int]]) -> bytes:
    return _encoder.encode(
        (
            [
                (
                    r.request_id,
                    r.start_pos,
                    r.num_tokens,
                    r.new_block_ids,
                    r.sample,
                    r.num_samples,
                    r.spec_token_ids,
                )
                for r in so.scheduled
            ],
            so.num_batched_tokens,
            so.new_requests,
            so.blocks_to_copy,
            so.finished_request_ids,
            so.preempted_request_ids,
            prev_sampled,
        )
    )


def decode_step(data: bytes | memoryview) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    scheduled, num_tokens, new, copies, finished, preempted, prev_sampled = _decoder.decode(data)
    so = SchedulerOutput(
        scheduled=[ScheduledRequest(*r) for r in scheduled],
        num_batched_tokens=num_tokens,
        new_requests=new,
        blocks_to_copy=copies,
        finished_request_ids=finished,
        preempted_request_ids=preempted,
    )
    return so, prev_sampled
