"""The batched sampler against straightforward references (torch.argmax, softmax + sort)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.sampler import Sampler, apply_penalties, validate_token_ids
from engine.outputs import NewRequestData
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import CachedRequestState

torch.set_num_threads(1)


def req(
    rid: str | int = "r",
    *,
    out: list[int] | None = None,
    prompt: list[int] | None = None,
    num_samples: int = 1,
    eos: int | None = None,
    **params,
) -> CachedRequestState:
    """A request as the runner holds it (what the sampler reads)."""
    state = CachedRequestState.from_new(
        NewRequestData(
            request_id=str(rid),
            prompt_token_ids=prompt if prompt is not None else [1, 2, 3],
            sampling_params=SamplingParams(**params),
            output_token_ids=out if out is not None else [],
            eos_token_id=eos,
        )
    )
    state.num_samples = num_samples
    return state


def reference_probs(row: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float):
    """vLLM's semantics the slow way: temperature, min_p, then top-k, then top-p renormalised."""
    p = torch.softmax(row.double() / t, -1)
    if min_p:
        p[p < min_p * p.max()] = 0
    vals, idx = p.sort(descending=True)
    if top_k:
        vals[top_k:] = 0
    vals /= vals.sum()
    if top_p < 1:
        vals[vals.cumsum(0) - vals >= top_p] = 0
        vals /= vals.sum()
    return torch.zeros_like(p).index_put_((idx,), vals)


def frequencies(row: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """Draw n tokens from one logits row: 4 batch rows of n/4 samples each, fixed seed."""
    logits = row.expand(4, -1).contiguous()
    reqs = [req(i, num_samples=n // 4, **params) for i in range(4)]
    tokens, _ = Sampler(seed=seed)(logits, reqs)
    counts = torch.bincount(torch.tensor(sum(tokens, [])), minlength=row.numel())
    return counts.double() / n


@pytest.mark.parametrize("vocab", [5, 64, 1000, 4099])
def test_greedy_equals_argmax(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[0, 1] = logits[0, vocab - 1] = 50.0  # a tie: the first index wins, as in argmax
    tokens, lps = Sampler()(logits, [req(i, temperature=0) for i in range(6)])
    assert tokens == [[t] for t in logits.argmax(-1).tolist()]
    assert lps == [None] * 6


def test_greedy_large_batch_fast_path() -> None:
    logits = torch.randn(256, 49152, generator=torch.Generator().manual_seed(0))
    tokens, _ = Sampler()(logits, [req(i, temperature=0) for i in range(256)])
    assert tokens == [[t] for t in logits.argmax(-1).tolist()]


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(1)) * 2
    argmax = [[t] for t in logits.argmax(-1).tolist()]
    s = Sampler(seed=3)
    assert s(logits, [req(i, temperature=1.0, top_k=1) for i in range(8)])[0] == argmax
    assert s(logits, [req(i, temperature=1.5, top_p=1e-6) for i in range(8)])[0] == argmax


def test_mixed_batch_greedy_rows_unaffected() -> None:
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(2))
    reqs = [
        req(0, temperature=0),
        req(1, temperature=0.8, top_p=0.9, seed=1),
        req(2, temperature=0),
        req(3, temperature=1.0, top_k=5, logprobs=2),
        req(4, temperature=0, presence_penalty=0.0),
        req(5, temperature=1.2, min_p=0.1, num_samples=3),
    ]
    tokens, lps = Sampler()(logits, reqs)
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 4)] == [[argmax[i]] for i in (0, 2, 4)]
    assert len(tokens[5]) == 3 and lps[3] is not None and lps[0] is None


def test_temperature_follows_softmax() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -1.0])
    for t in (0.5, 1.0, 1.7):
        freq = frequencies(row, 4000, temperature=t)
        expected = torch.softmax(row.double() / t, -1)
        assert (freq - expected).abs().max() < 0.03, (t, freq, expected)


@pytest.mark.parametrize(
    "t, top_k, top_p, min_p",
    [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.7, 0, 1.0, 0.3), (1.0, 3, 0.7, 0.0)],
)
def test_truncation_small_vocab_distribution(t, top_k, top_p, min_p) -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5, -3.0])
    freq = frequencies(row, 4000, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = reference_probs(row, t, top_k, top_p, min_p)
    assert torch.all(freq[expected == 0] == 0)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


@pytest.mark.parametrize(
    "scale, t, top_k, top_p, min_p",
    [
        (3.0, 0.7, 0, 0.9, 0.0),  # nucleus of a few dozen tokens: the 128-block candidates
        (6.0, 1.0, 0, 0.9, 0.0),  # a handful: the first 16 blocks suffice
        (0.5, 1.0, 0, 0.5, 0.0),  # thousands of tokens: the full sort
        (1.0, 1.0, 40, 0.9, 0.0),
        (1.0, 1.0, 300, 1.0, 0.0),  # more top_k than candidate blocks
        (2.0, 1.0, 0, 0.8, 0.02),
    ],
)
def test_truncation_large_vocab_keeps_exactly_the_reference_set(
    scale, t, top_k, top_p, min_p
) -> None:
    row = torch.randn(20000, generator=torch.Generator().manual_seed(4)) * scale
    expected = reference_probs(row, t, top_k, top_p, min_p)
    freq = frequencies(row, 3000, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    assert torch.all(freq[expected == 0] == 0)  # never outside the kept set
    # The draws carry the bulk of the reference mass of what they hit.
    hit = expected[freq > 0].sum()
    assert hit > min(0.9, 0.999 * (expected > 0).sum() / 20000)
    support = int((expected > 0).sum())
    if support <= 50:  # small kept sets: every token shows up, at about its probability
        assert torch.all(freq[expected > 0.01] > 0)
        assert (freq - expected).abs().max() < 0.04


def test_seeded_reproducible_across_batch_composition() -> None:
    vocab = 5000
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(vocab, generator=gen) * 0.3  # flat: many plausible tokens

    def run(position: int, neighbours: int, seed_offset: int) -> list[int]:
        s = Sampler(seed=seed_offset)
        out: list[int] = []
        for _step in range(6):
            rows = [torch.randn(vocab, generator=gen) for _ in range(neighbours)]
            reqs = [
                req(f"n{i}", temperature=1.0, seed=(i if i % 2 else None), top_p=0.9)
                for i in range(neighbours)
            ]
            rows.insert(position, target)
            reqs.insert(position, req("me", temperature=0.9, top_p=0.95, seed=1234, out=out))
            tokens, _ = s(torch.stack(rows), reqs)
            out.append(tokens[position][0])
        return out

    a = run(0, 2, 0)
    assert run(3, 5, 9) == a
    assert run(0, 0, 7) == a
    assert len(set(a)) > 1  # really sampling, not collapsing to argmax


def test_different_seeds_differ_and_n_samples_are_distinct() -> None:
    row = torch.zeros(1, 1000)  # uniform
    s = Sampler()
    a = s(row, [req("a", temperature=1.0, seed=1, num_samples=8)])[0][0]
    b = s(row, [req("b", temperature=1.0, seed=2, num_samples=8)])[0][0]
    assert len(a) == 8 and a != b
    assert len(set(a)) > 4  # independent draws, not copies


def test_greedy_n_gives_copies() -> None:
    row = torch.randn(1, 100, generator=torch.Generator().manual_seed(6))
    tokens, _ = Sampler()(row, [req(temperature=0, num_samples=4)])
    assert tokens == [[int(row.argmax())] * 4]


def test_drop_forgets_generators() -> None:
    s = Sampler()
    row = torch.zeros(2, 300)
    reqs = [req("a", temperature=1.0, seed=1), req("b", temperature=1.0, seed=2)]
    first = s(row, reqs)[0]
    assert s.num_tracked_requests == 2
    s.drop(["a", "missing"])
    assert s.num_tracked_requests == 1
    # Draws depend on (seed, output length) only: a dropped and recreated generator (e.g.
    # after preemption) gives the same token again.
    assert s(row, reqs)[0] == first
    s.drop(["a", "b"])
    assert s.num_tracked_requests == 0


def test_penalties_match_hand_computation() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    prompt = [[0, 1], [5]]
    output = [[3, 3, 4], [2, 2, 2, 0]]
    apply_penalties(
        x,
        prompt,
        output,
        repetition=torch.tensor([2.0, 1.0]),
        presence=torch.tensor([0.5, 0.25]),
        frequency=torch.tensor([0.1, 0.2]),
    )
    # Row 0: repetition on {0, 1, 3, 4}; then output counts {3: 2, 4: 1}.
    r0 = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 0.2, -2.0 * 2 - 0.5 - 0.1, 1.0]
    # Row 1: no repetition penalty; output counts {2: 3, 0: 1}.
    r1 = [1.0 - 0.25 - 0.2, 1.0, 1.0 - 0.25 - 0.6, 1.0, 1.0, 1.0]
    torch.testing.assert_close(x, torch.tensor([r0, r1]))


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]]).repeat(3, 1)
    reqs = [
        req(0, temperature=0, out=[0]),
        req(1, temperature=0, out=[0], presence_penalty=0.5),
        req(2, temperature=0, prompt=[0], repetition_penalty=1.1),
    ]
    assert Sampler()(logits, reqs)[0] == [[0], [1], [1]]


def test_logit_bias_forces_a_token() -> None:
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(7))
    reqs = [
        req(0, temperature=0, logit_bias={17: 100.0}),
        req(1, temperature=1.0, logit_bias={42: 100.0}, num_samples=5),
    ]
    assert Sampler()(logits, reqs)[0] == [[17], [42] * 5]
    banned = int(logits[0].argmax())
    tokens, _ = Sampler()(logits[:1], [req(temperature=0, logit_bias={banned: -100.0})])
    assert tokens[0][0] != banned


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]]).repeat(4, 1)  # eos=2 then stop id 3 lead
    common = {"temperature": 0, "eos": 2, "min_tokens": 2, "stop_token_ids": [3]}
    reqs = [
        req(0, out=[], **common),
        req(1, out=[5], **common),
        req(2, out=[5, 5], **common),  # min_tokens reached: eos allowed again
        req(3, out=[], ignore_eos=True, **common),  # eos doesn't stop, so it isn't masked
    ]
    assert Sampler()(logits, reqs)[0] == [[1], [1], [2], [2]]


def test_logprobs_are_raw_log_softmax_with_ranks_and_sorted_top() -> None:
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(8))
    forced = int(logits[1].argsort(descending=True)[9])  # the 10th most likely token
    reqs = [
        req(0, temperature=0, logprobs=5),
        req(1, temperature=0, logprobs=3, logit_bias={forced: 100.0}),
        req(2, temperature=1.0, logprobs=0, num_samples=2, presence_penalty=1.0, out=[4]),
    ]
    tokens, lps = Sampler()(logits, reqs)
    ref = torch.log_softmax(logits, -1)  # of the logits as given: before bias and penalties
    assert tokens[1] == [forced]
    for i, k in enumerate((5, 3, 0)):
        assert lps[i] is not None and len(lps[i]) == len(tokens[i])
        top_v, top_i = ref[i].topk(k) if k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
        for t, lp in zip(tokens[i], lps[i], strict=True):
            assert lp.token_id == t
            assert lp.logprob == pytest.approx(ref[i, t].item(), abs=1e-5)
            assert lp.rank == int((ref[i] > ref[i, t]).sum()) + 1
            assert [tid for tid, _ in lp.top] == top_i.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-5)
    assert lps[0][0].rank == 1 and lps[1][0].rank == 10


def test_validate_token_ids() -> None:
    validate_token_ids([0, 5, 99], 100)
    for bad in ([100], [-1], ["3"], [1.5]):
        with pytest.raises(ValueError, match="out of range"):
            validate_token_ids(bad, 100)


@pytest.mark.parametrize("with_greedy_neighbour", [False, True])
def test_penalised_draws_equal_draws_from_prepenalised_logits(with_greedy_neighbour) -> None:
    # Same seeds, same processed distribution => same tokens, whichever internal path runs
    # (in place on the penalised copy, or rows gathered next to a greedy row).
    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(9))
    outs = [[5, 5, 9], [1, 2], [7]]
    params = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2}
    pen = [req(i, temperature=0.9, seed=i, top_p=0.95, out=o, **params) for i, o in enumerate(outs)]
    manual = logits.clone()
    apply_penalties(
        manual,
        [r.prompt_token_ids for r in pen],
        outs,
        torch.full((3,), 1.3),
        torch.full((3,), 0.4),
        torch.full((3,), 0.2),
    )
    plain = [req(i, temperature=0.9, seed=i, top_p=0.95, out=o) for i, o in enumerate(outs)]
    if with_greedy_neighbour:
        logits, manual = torch.cat([logits, logits[:1]]), torch.cat([manual, manual[:1]])
        pen, plain = pen + [req("g", temperature=0)], plain + [req("g", temperature=0)]
    assert Sampler()(logits, pen)[0][:3] == Sampler()(manual, plain)[0][:3]


def test_bf16_logits_accepted() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(10)).bfloat16()
    tokens, _ = Sampler()(logits, [req(i, temperature=0) for i in range(4)])
    assert tokens == [[t] for t in logits.float().argmax(-1).tolist()]
