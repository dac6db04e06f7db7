"""engine.spec_decode.rejection: greedy verification is argmax-exact; for sampling, the
emitted tokens follow the target distribution (chi-square at significance 0.001, fixed
seeds) and target_probs is the distribution the sampler itself draws from."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stats_testing import chi2_critical, goodness_of_fit  # noqa: E402

from engine.layers.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec_decode.rejection import target_probs, verify  # noqa: E402

V = 24


@dataclass
class State:
    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    num_samples: int = 1


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 2.0


def test_greedy_accepts_while_argmax():
    logits = _logits(4, 0)
    am = logits.argmax(-1).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    g = torch.Generator().manual_seed(0)
    sampler = Sampler()
    # all accepted: the bonus token too
    out, lps = verify(logits, [State("a", sp)], [am[:3]], sampler, g)
    assert out == [am[:4]] and lps == [None]
    # the second draft is wrong: the target's token replaces it, nothing after
    wrong = (am[1] + 1) % V
    out, _ = verify(logits, [State("a", sp)], [[am[0], wrong, am[2]]], sampler, g)
    assert out == [[am[0], am[1]]]
    # two requests in one call, rows back to back
    both = torch.cat([logits[:2], logits[:3]])
    out, _ = verify(both, [State("a", sp), State("b", sp)], [[am[0]], [wrong, 0]], sampler, g)
    assert out == [[am[0], am[1]], [am[0]]]


def test_greedy_penalties_count_the_drafts():
    """Row j is penalised over the outputs plus drafts[:j], as a sequential step would be."""
    sp = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=2.0)
    logits = _logits(3, 1)
    sampler = Sampler()
    state = State("a", sp)
    expected, outputs = [], []
    for j in range(3):
        tok, _ = sampler(logits[j : j + 1].clone(), [State("a", sp, output_token_ids=outputs)])
        expected.append(tok[0][0])
        outputs = outputs + tok[0]
    out, _ = verify(logits, [state], [expected[:2]], sampler, torch.Generator())
    assert out == [expected]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.1, "top_k": 8, "top_p": 0.9},
    ],
)
def test_target_probs_is_the_samplers_distribution(params):
    sp = SamplingParams(max_tokens=4, **params)
    row = _logits(1, 2)
    n = 3000
    sampler = Sampler(seed=5)
    tokens, _ = sampler(row.expand(n, V).contiguous(), [State(f"r{i}", sp) for i in range(n)])
    p = target_probs(row, sp)[0]
    stat, df = goodness_of_fit([t[0] for t in tokens], dict(enumerate(p.tolist())))
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 6}])
def test_rejection_keeps_the_target_distribution(params):
    """Draft d0 (a likely token) then d1: the first emitted token ~ p0, and after an accepted
    d0 the next ~ p1, with many requests verified in one call."""
    sp = SamplingParams(max_tokens=10, **params)
    rows = _logits(3, 3)
    p = target_probs(rows, sp)
    d0 = int(p[0].argsort(descending=True)[1])  # the second most likely: often rejected
    d1 = int(p[1].argmax())
    n = 3000
    logits = rows.repeat(n, 1)
    states = [State(f"r{i}", sp) for i in range(n)]
    g = torch.Generator().manual_seed(11)
    out, _ = verify(logits, states, [[d0, d1]] * n, Sampler(), g)
    first = [o[0] for o in out]
    stat, df = goodness_of_fit(first, dict(enumerate(p[0].tolist())))
    assert stat < chi2_critical(df), (stat, df)
    second = [o[1] for o in out if o[0] == d0]
    assert 0.1 * n < len(second) < 0.9 * n  # the test exercises both branches
    stat, df = goodness_of_fit(second, dict(enumerate(p[1].tolist())))
    assert stat < chi2_critical(df), (stat, df)
    for o in out:  # a rejection ends the row; all accepted gives the bonus token
        assert len(o) <= 3
        if len(o) == 3:
            assert o[:2] == [d0, d1]


def test_logprobs_of_emitted_tokens():
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    logits = _logits(3, 4)
    am = logits.argmax(-1).tolist()
    out, lps = verify(logits, [State("a", sp)], [am[:2]], Sampler(), torch.Generator())
    assert out == [am]
    ref = torch.log_softmax(logits, -1)
    assert [lp.token_id for lp in lps[0]] == am
    for j, lp in enumerate(lps[0]):
        assert lp.rank == 1
        assert lp.logprob == pytest.approx(float(ref[j, am[j]]), abs=1e-5)
        assert len(lp.top) == 2
