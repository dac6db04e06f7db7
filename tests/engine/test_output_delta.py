"""engine.output_delta: a step's outputs as what they add (the engine process's pipe). Through
a real engine's step loop, every output the decoder rebuilds equals the one the engine made
(n samples, logprobs, prompt logprobs, stop strings, a stream interval, an abort mid-way), the
prompt crosses once, a step's wire stays small however long the request, and both sides forget
a request at its finish."""

from __future__ import annotations

import copy
import pickle

import pytest

from engine import LLM, SamplingParams
from engine.output_delta import DeltaDecoder, DeltaEncoder

PROMPT = list(range(20, 32))


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_num_seqs=8)
    made = {n: LLM(str(tiny_llama_dir), stream_interval=n, **kw) for n in (1, 3)}
    yield made
    for llm in made.values():
        llm.shutdown()


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]], abort_after=None):
    """Steps the engine to the end; each step's outputs through encode, pickle and decode."""
    engine, encoder, decoder = llm.engine, DeltaEncoder(), DeltaDecoder()
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps, made, rebuilt = 0, [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if abort_after is not None and steps == abort_after[1]:
            aborted = engine.abort_request(abort_after[0])
            outputs.append(aborted)
        wire = pickle.loads(pickle.dumps(encoder.encode(outputs)))
        decoded = decoder.decode(wire)
        assert decoded == outputs
        made.append(copy.deepcopy(outputs))
        rebuilt.append(decoded)
        yield outputs, wire
    assert rebuilt == made  # nothing handed out changed afterwards (the decoder's lists grow)
    assert encoder.num_requests == decoder.num_requests == 0


def test_the_decoded_outputs_are_the_engines(engines):
    text = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for llm in engines.values():
        requests = {
            "plain": (PROMPT, text),
            "samples": (PROMPT[:7], SamplingParams(max_tokens=9, n=2, temperature=1.0, seed=1)),
            "logprobs": (
                PROMPT[3:],
                SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=1),
            ),
            "aborted": (PROMPT[5:], SamplingParams(max_tokens=40, ignore_eos=True)),
        }
        seen = set()
        for outputs, _ in _run(llm, requests, abort_after=("aborted", 4)):
            seen |= {o.request_id for o in outputs}
        assert seen == set(requests)


def test_a_stop_string_cut_reaches_the_parent(engines):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    last = None
    for outputs, _ in _run(engines[1], {"r": (PROMPT, greedy)}):
        last = outputs[-1]
    stop = last.outputs[0].text[2:4]
    assert stop
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=[stop])
    for outputs, _ in _run(engines[3], {"r": (PROMPT, params)}):
        last = outputs[-1] if outputs else last  # the interval skips some steps
    assert last.outputs[0].finish_reason == "stop" and stop not in last.outputs[0].text


def test_the_prompt_crosses_once_and_a_step_stays_small(engines):
    long_prompt = [20 + i % 90 for i in range(400)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    sizes = []
    for step, (outputs, wire) in enumerate(_run(engines[1], {"long": (long_prompt, params)})):
        heads = [w[1] for w in wire]
        assert (heads[0] is not None) == (step == 0)
        sizes.append(len(pickle.dumps(wire)))
        if step > 0:  # the cumulative output pickles whole: the prompt and every token so far
            assert sizes[-1] * 10 < len(pickle.dumps(outputs))
    assert sizes[0] > 400 and max(sizes[1:]) < 400  # one token's tail, whatever the length
