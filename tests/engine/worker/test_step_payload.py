"""The step payload a tensor-parallel worker gets: the exact bytes of WorkerGroup's channel
(multiproc.step_message) are O(batch), whatever the context length, and decode back to the
same SchedulerOutput."""

from __future__ import annotations

import pickle
import random

from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.worker.multiproc import _call_decoder, step_message
from engine.worker.step_payload import decode_step, encode_step

BATCH = 256
BLOCK = 16


def _decode_step_bytes(context: int) -> tuple[int, int]:
    """(bytes of a decode step sent to a worker, pickle of the request lists it replaces) for
    BATCH requests of `context` tokens each, scheduled by the real scheduler."""
    rng = random.Random(context)
    max_model_len = context + 64
    per_request = -(-max_model_len // BLOCK)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=BATCH,
            max_num_batched_tokens=65536,
            max_model_len=max_model_len,
            block_size=BLOCK,
        ),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        num_blocks=BATCH * per_request + 1,
    )
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
    for i in range(BATCH):
        prompt = [rng.randrange(32000) for _ in range(context)]
        sched.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2))
    sampled: dict[str, list[int]] = {}
    for _ in range(200):  # prefill everyone, then decode a few steps
        out = sched.schedule()
        message = step_message(out, sampled)
        sampled = {s.request_id: [rng.randrange(32000)] for s in out.scheduled if s.sample}
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        decoding = all(s.num_tokens == 1 for s in out.scheduled)
        if decoding and len(out.scheduled) == BATCH and len(sampled) == BATCH:
            break
    assert decoding and not out.new_requests and len(out.scheduled) == BATCH
    # What the old payload pickled per request: its whole prompt, outputs and block table.
    old = [
        (r.all_token_ids, r.prompt_token_ids, sched.kv_cache_manager.get_block_ids(r.request_id))
        for r in sched.running
    ]
    return len(message), len(pickle.dumps(old, protocol=pickle.HIGHEST_PROTOCOL))


def test_decode_step_payload_does_not_grow_with_context():
    short, old_short = _decode_step_bytes(100)
    long, old_long = _decode_step_bytes(8000)
    # Ids, positions and the previous step's samples: a few dozen bytes a request. Longer
    # contexts only widen the integers (position 100 -> 8000: one msgpack int 1 -> 3 bytes).
    assert short <= 48 * BATCH and long <= 48 * BATCH
    assert long - short <= 4 * BATCH
    assert old_long > 50 * old_short > 50 * long  # what the request lists alone would cost


def test_payload_round_trips():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=64, block_size=8),
        CacheConfig(block_size=8),
        num_blocks=40,
    )
    params = SamplingParams(
        n=2, temperature=0.7, seed=3, logit_bias={5: -1.5}, stop=["x"], stop_token_ids=[9]
    )
    sched.add_request(Request("a", list(range(30)), params, eos_token_id=2))
    sched.add_request(Request("b", list(range(50, 70)), SamplingParams(max_tokens=4)))
    sampled: dict[str, list[int]] = {}
    received = {}  # the new requests as a worker decodes them
    for step in range(6):
        out = sched.schedule()
        if step == 3:
            out.finished_request_ids.append("gone")
        message = step_message(out, sampled)
        method, body = _call_decoder.decode(message)
        assert method == "execute_model"
        assert bytes(body) == encode_step(out, sampled)
        assert decode_step(body) == (out, sampled)
        received.update({n.request_id: n for n in decode_step(body)[0].new_requests})
        sampled = {s.request_id: [7 + step] * s.num_samples for s in out.scheduled if s.sample}
        sched.update_from_output(out, ModelRunnerOutput(sampled))
    # The n=2 parent, its forked sample (own seed, its first token as output) and "b".
    assert sorted(received) == ["a", "a#1", "b"]
    assert received["a"].sampling_params == params and received["a"].eos_token_id == 2
    assert received["a#1"].sampling_params.seed == 4 and len(received["a#1"].output_token_ids) == 1
    assert received["a#1"].prompt_token_ids == list(range(30))


def test_drafts_travel_to_the_workers():
    """A request scheduled with drafts (speculative decoding) keeps them on the wire."""
    from engine.outputs import ScheduledRequest, SchedulerOutput

    so = SchedulerOutput(
        scheduled=[
            ScheduledRequest("a", 9, 4, [3], True, 1, [5, 6, 7]),
            ScheduledRequest("b", 0, 9, [1, 2], True),
        ],
        num_batched_tokens=13,
    )
    back, prev = decode_step(encode_step(so, {"a": [4]}))
    assert back.scheduled == so.scheduled and prev == {"a": [4]}
