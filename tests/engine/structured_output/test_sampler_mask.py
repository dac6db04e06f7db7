"""The grammar bitmask in both samplers (the GPU one on CPU tensors): masked rows draw only
allowed tokens, unmasked rows are exactly as without a mask, logprobs stay raw."""

from __future__ import annotations

import torch

from engine.layers.gpu_sampler import GpuSampler
from engine.layers.sampler import Sampler
from engine.outputs import NewRequestData
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output.bitmask import RowMask
from engine.worker.input_batch import CachedRequestState, SamplingTensors

V = 300
SO = StructuredOutputsParams(regex="x")


def _req(rid, **params) -> CachedRequestState:
    sp = SamplingParams(**params)
    return CachedRequestState.from_new(NewRequestData(str(rid), [1, 2], sp, [], None))


def _mask(allowed_rows: list[list[int]]) -> torch.Tensor:
    words = torch.zeros(len(allowed_rows), -(-V // 32), dtype=torch.int64)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            words[r, t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)


def _requests():
    return [
        _req(0, temperature=0.0),
        _req(1, temperature=0.0, structured_outputs=SO),
        _req(2, temperature=1.0, seed=4),
        _req(3, temperature=1.0, seed=7, structured_outputs=SO, logprobs=2),
    ]


def _gpu(logits, reqs, mask):
    sampler = GpuSampler(SamplingTensors("cpu"), seed=0)
    for r in reqs:
        sampler.params.add(r.request_id, r.sampling_params)
    sampler.params.flush()
    rows = sampler.stage(
        list(range(len(reqs))),
        [sampler.params.column[r.request_id] for r in reqs],
        [0] * len(reqs),
    )
    return [t[0] for t in sampler.sample(logits, reqs, rows, None, mask).tolist()]


def test_constrained_rows_never_leave_the_mask_and_others_are_untouched():
    torch.manual_seed(0)
    allowed = [[7, 250], [31, 32, 299]]
    for trial in range(20):
        logits = torch.randn(4, V) * 3
        reqs = _requests()
        mask = RowMask([1, 3], _mask(allowed))
        cpu_tokens, lps = Sampler(seed=trial)(logits.clone(), reqs, mask)
        plain_tokens, _ = Sampler(seed=trial)(logits.clone(), reqs)
        assert cpu_tokens[1][0] in allowed[0] and cpu_tokens[3][0] in allowed[1]
        assert cpu_tokens[0] == plain_tokens[0] and cpu_tokens[2] == plain_tokens[2]
        assert cpu_tokens[1][0] == max(allowed[0], key=lambda t: logits[1, t])
        # logprobs are the raw model's (vLLM's default), mask or not
        raw = torch.log_softmax(logits[3], -1)[cpu_tokens[3][0]]
        assert abs(lps[3][0].logprob - raw.item()) < 1e-4

        gpu_tokens = _gpu(logits.clone(), reqs, mask)
        gpu_plain = _gpu(logits.clone(), reqs, None)
        assert gpu_tokens[1] in allowed[0] and gpu_tokens[3] in allowed[1]
        assert gpu_tokens[0] == gpu_plain[0] and gpu_tokens[2] == gpu_plain[2]
        assert gpu_tokens[1] == cpu_tokens[1][0]


def test_a_grammar_request_is_never_plain_greedy():
    assert Sampler.plain_greedy([_req(0, temperature=0.0)])
    assert not Sampler.plain_greedy([_req(0, temperature=0.0, structured_outputs=SO)])
